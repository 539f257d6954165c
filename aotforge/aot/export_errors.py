"""The one error every export entry point raises (its own module: the export stages below
``export.py`` raise it too)."""


class ExportError(RuntimeError):
    """The function or module cannot be exported as it is; the message says what to change."""
