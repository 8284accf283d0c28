"""The fleet's configuration: its frozen shape, the one database reader, validation, TOML."""
