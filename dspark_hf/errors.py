"""What dspark-hf raises for input a user can fix, told apart from bugs.

`dspark` ends a command in one line for these, and for the classes transformers and the Hub raise for bad values,
files and packages (ValueError, OSError, ImportError); any other exception is a bug and keeps its traceback. Each
class here is also the built-in one Python code would catch, so `except TypeError` still works."""

from __future__ import annotations


class UserError(Exception):
    """Raised by dspark-hf for input the user can fix; the message says what is wrong and how to fix it."""


class WrongTypeError(UserError, TypeError):
    """An argument of the wrong kind (a class where an instance goes, an unknown field, ...)."""


class UnsupportedError(UserError, NotImplementedError):
    """A setting or checkpoint feature dspark-hf does not reproduce."""


class NotFiniteError(UserError, FloatingPointError):
    """Weights that make NaN or inf where probabilities or confidences go."""
