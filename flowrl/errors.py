"""User-facing errors: each is one line that says what to change."""


class FlowRLError(Exception):
    """An error the CLI prints as a single line (no traceback)."""


class ConfigError(FlowRLError):
    """Bad configuration: unknown key, wrong type, out-of-range value, missing file."""


class RewardError(FlowRLError):
    """A reward cannot be computed (wrong shape, out-of-domain prompt, missing weights)."""
