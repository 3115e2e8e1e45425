"""Errors whose message is one sentence a user can act on (shown as-is in the UI and CLI)."""


class LmscopeError(Exception):
    """Base class: str(err) is a complete, user-facing sentence."""


class ModelLoadError(LmscopeError):
    pass


class SettingsError(LmscopeError):
    pass


class PromptError(LmscopeError):
    pass
