"""tgis: a text-generation inference server toolkit."""

__version__ = "0.1.0"
