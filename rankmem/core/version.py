"""The package version, in one place the package face and the writers both read."""

__version__ = "0.1.0"
