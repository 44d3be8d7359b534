"""The conversion room's error type (a leaf module: every conversion module may raise it)."""


class ConversionError(ValueError):
    """A model or checkpoint that cannot be converted; one line naming the file and field."""
