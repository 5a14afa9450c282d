"""Exceptions raised by steptrace.

Every error steptrace raises derives from :class:`SteptraceError`, and also from the
built-in exception a caller would expect (``ValueError`` for a bad value, ``TypeError``
for an unknown option, ``RuntimeError`` for misuse), so either can be caught.
"""


class SteptraceError(Exception):
    """Base class of every steptrace error."""


class ConfigError(SteptraceError, ValueError):
    """A configuration value is out of range or unusable (raised before any file is created)."""


class UnknownOptionError(SteptraceError, TypeError):
    """A configuration option name that steptrace does not know."""


class UsageError(SteptraceError, RuntimeError):
    """The profiler was used out of order: a phase outside a step, a step inside a step,
    a phase nested in itself, or an end without a start."""


class LogFormatError(SteptraceError, ValueError):
    """A log file is not a readable steptrace log (corrupt line, wrong schema, ...)."""


class UsageWarning(UserWarning):
    """steptrace was used in a way it tolerates but cannot time as asked (e.g. the loader
    wrapped by ``prof.data()`` advanced inside a step); training goes on."""


__all__ = ["SteptraceError", "ConfigError", "UnknownOptionError", "UsageError", "LogFormatError", "UsageWarning"]
