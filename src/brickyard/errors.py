"""The one exception type a user can cause; the CLI prints it as one line and exits non-zero."""


class BrickyardError(Exception):
    """A user-facing error: the message is one clear sentence, shown without a traceback."""

    exit_code = 2


class RendezvousError(BrickyardError):
    """Joining the job failed in a way only this rank sees (rank 0 cannot tell it): said on every rank's console."""

    every_rank = True


class JobEnvironmentError(BrickyardError):
    """The launcher's environment (``RANK``, ``SLURM_NTASKS`` ...) is not one brickyard can run in: said on
    every rank's console, since the rank itself may be what is wrong."""

    every_rank = True


class CollectiveError(BrickyardError):
    """A collective that failed on this rank (a lost peer, a timeout), most often because another rank failed
    first: brickyard's launcher says it only when no rank left a cause of its own."""

    follows = True


class ConfigError(BrickyardError):
    """A configuration key, type or value that is not allowed."""


class DataError(BrickyardError):
    """Missing, truncated or corrupt data files."""


class CheckpointError(BrickyardError):
    """A checkpoint that cannot be read or does not fit the model."""


class DeviceError(BrickyardError):
    """A device that does not exist or cannot do what the config asks."""


class UserCodeError(BrickyardError):
    """An exception raised in the user's own code (a callback, ``loss_fn``, ``train_step``). The message is
    one sentence naming where (what the CLI prints); the user's exception is the ``__cause__`` and its
    traceback, down to the user's line, is this exception's traceback (what Python prints from ``fit``)."""


def reason(err: BaseException, limit: int = 200, joined: bool = False) -> str:
    """An exception as the short reason inside one of brickyard's sentences: its first line, at most
    ``limit`` characters, or its type's name when it says nothing. ``joined``: all its lines joined into one
    (pydantic and HTTP errors put the reason on the second), cut to ``limit`` with "..." where longer."""
    text = str(err).strip()
    if joined:
        text = " ".join(text.split())
        return (text[:limit - 3] + "...") if len(text) > limit else (text or type(err).__name__)
    return text.splitlines()[0][:limit] if text else type(err).__name__


def user_code_error(where: str, err: BaseException) -> UserCodeError:
    """``raise user_code_error("callback Boom.on_step_end", e) from e`` inside an ``except`` block."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else "(no message)"
    return UserCodeError(f"{where} raised {type(err).__name__}: {text}.").with_traceback(err.__traceback__)


def is_comm_failure(e: BaseException) -> bool:
    """An error that says a collective lost its peers (a timeout, a closed connection) rather than a bug."""
    text = str(e).lower()
    return any(k in text for k in ("timed out", "timeout", "connection closed", "connection reset", "nccl", "gloo"))
