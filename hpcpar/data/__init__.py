"""Data: real byte-level text from the Python standard library, the digits images."""
