"""User-facing errors: each is one line that says what to change."""


class FlowRLError(Exception):
    """An error the CLI prints as a single line (no traceback)."""


class ConfigError(FlowRLError):
    """Bad configuration: unknown key, wrong type, out-of-range value, missing file."""


class RewardError(FlowRLError):
    """A reward cannot be computed (wrong shape, out-of-domain prompt, missing weights)."""


class RewardServerError(FlowRLError):
    """The reward server cannot start (a busy port, a bad address)."""


class Stopped(FlowRLError):
    """Training stopped by SIGTERM after saving a checkpoint; the CLI exits with 128 + 15."""

    exit_code = 143
