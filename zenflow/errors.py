"""Exceptions for problems the user can fix (bad input, missing data or model).

The CLI turns any ``UserInputError`` into one red line and exit code 2; anything else is a
bug and keeps its traceback. Messages are whole sentences: what is wrong, where, and how
to fix it.
"""


class UserInputError(Exception):
    """Base for errors caused by the user's input or environment, not by a bug."""


class ModelSourceError(UserInputError):
    """A model or tokenizer cannot be found or loaded from any allowed source."""


class DataError(UserInputError):
    """A task's data is missing, unreadable or malformed."""


class EngineError(UserInputError, ValueError):
    """The engine cannot run with this model/config combination (message says how to fix)."""
