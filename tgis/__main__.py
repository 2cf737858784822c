"""`python -m tgis` runs the CLI."""

from tgis.cli import main

main()
