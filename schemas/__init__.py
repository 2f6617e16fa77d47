"""Configuration and record schemas (msgspec Structs)."""
