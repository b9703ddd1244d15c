"""The `kite` command line: a thin shell over the library. One module per command group."""
