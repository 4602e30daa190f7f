"""Errors raised by cudaformers. Each message names the problem and the fix."""


class CudaformersError(Exception):
    """Base class for errors raised by cudaformers."""


class CheckpointError(CudaformersError, ValueError):
    """A checkpoint file is missing, truncated, corrupt or does not match the model."""


class UnsupportedError(CudaformersError, ValueError):
    """A requested feature or combination is not supported here; the message says what would work."""
