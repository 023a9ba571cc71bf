"""The broker package's one error base."""


class BrokerError(RuntimeError):
    """The broker could not be reached, configured or used as the run needs."""
