"""One module per `tgis` subcommand; each is thin: parse flags, call the core."""
