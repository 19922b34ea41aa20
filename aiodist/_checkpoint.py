"""Checkpoints: variables saved to one ``.npz`` file and restored into any strategy.

A checkpoint stores one array per variable name: the value a reader sees in
cross-replica context (the primary copy of a mirrored variable, the aggregate of
a sync-on-read one). So it restores into a strategy with any number of replicas
or devices. Saving writes a temporary file beside the target, flushes it to disk
and renames it over the target: a crash mid-save leaves the previous checkpoint
(or none), never a truncated one. Restoring checks every name, shape and dtype
(from the arrays' headers, before it reads them) and changes nothing unless all
match; a file that is damaged or no checkpoint raises ``InvalidArgumentError``
naming it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from . import _context
from ._checks import file_to_write
from ._errors import ContextError, InvalidArgumentError
from ._variables import Variable

__all__ = ["restore_variables", "save_variables"]


def _by_name(variables: Mapping[str, Variable] | Sequence[Variable], where: str) -> dict:
    if isinstance(variables, Mapping):
        named = dict(variables)
        for name, variable in named.items():
            if not isinstance(name, str) or not isinstance(variable, Variable):
                raise InvalidArgumentError(
                    f"{where}: the entry {name!r}: {variable!r} is not a str name and an "
                    "aiodist.Variable; pass a dict {name: aiodist.Variable} with str names."
                )
    elif isinstance(variables, Sequence) and not isinstance(variables, str | bytes):
        named = {}
        for variable in variables:
            if not isinstance(variable, Variable):
                raise InvalidArgumentError(
                    f"{where}: {variable!r} in the list is not an aiodist.Variable; pass "
                    "variables only (or a dict {name: variable})."
                )
            if variable.name in named:
                raise InvalidArgumentError(
                    f"{where}: two variables are named {variable.name!r}; give each a "
                    "unique name= (or pass a dict {name: variable})."
                )
            named[variable.name] = variable
    else:
        named = None
    if not named or not all(isinstance(v, Variable) for v in named.values()):
        raise InvalidArgumentError(
            f"{where}: variables={variables!r}; expected a non-empty dict "
            "{name: aiodist.Variable} or a list of uniquely named aiodist.Variable."
        )
    for name in named:
        if "\0" in name:  # a zip member's name ends at NUL: the file would lose it
            raise InvalidArgumentError(
                f"{where}: the name {name!r} holds a NUL character, which a checkpoint "
                "cannot store; rename the variable (or pass a dict with other names)."
            )
    return named


def _require_outside_replicas(where: str) -> None:
    if _context.current_replica() is not None:
        raise ContextError(
            f"{where}() was called inside a replica function; call it in cross-replica "
            "context (outside strategy.run, or in a merge_fn)."
        )


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new file beside ``path``. Created with mode 0o666 so the umask applies, as for
    any file the user writes (``tempfile.mkstemp`` would force 0o600)."""
    while True:
        temporary = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(temporary)
        except FileExistsError:
            continue


class _Abandoned(Exception):
    """The save was cancelled before its file was in place (raised in its thread)."""


class _Writing:
    """A save's thread and its caller agree, under one lock, on whether the file is
    put in place: a thread is not cancelled with the task awaiting it, and a
    cancelled save (``wait_for`` timing out, a shutdown) renamed its file over the
    target later, possibly over that of a save started after the cancellation."""

    __slots__ = ("abandoned", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False

    def check(self) -> None:
        if self.abandoned:
            raise _Abandoned


def _atomic_write(path: Path, arrays: dict[str, np.ndarray], writing: _Writing) -> None:
    fd, temporary = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as file:
            # The .npz layout (one NAME.npy per array in a zip), written member by
            # member: np.savez(**arrays) would take a variable named "file" or
            # "allow_pickle" for one of its own parameters.
            with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED) as archive:
                for name, array in arrays.items():
                    writing.check()  # (no more writing once nobody waits for it)
                    with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, array, allow_pickle=False)
            file.flush()
            os.fsync(file.fileno())
        with writing.lock:
            writing.check()
            os.replace(temporary, path)
    except BaseException as exc:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(exc, _Abandoned):
            return
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


async def save_variables(
    path: str | os.PathLike, variables: Mapping[str, Variable] | Sequence[Variable]
) -> Path:
    """Save ``variables`` to ``path`` (an ``.npz`` file), atomically. Returns the path.

    The values saved are those when the call is made. A save cancelled before its
    file is in place leaves the file at ``path`` as it was."""
    _require_outside_replicas("save_variables")
    named = _by_name(variables, "save_variables")
    target = Path(path)
    # (A folder given: the rename over it failed only after the whole file was
    # written, naming the temporary file: "Is a directory: '.ckpt.1f2e….tmp' -> 'ckpt'".)
    file_to_write(target, f"save_variables: cannot write {str(path)!r}", "checkpoint.npz")
    snapshot = {name: np.array(v._saved_value(), copy=True) for name, v in named.items()}
    writing = _Writing()
    try:
        await asyncio.to_thread(_atomic_write, target, snapshot, writing)
    except asyncio.CancelledError:
        with writing.lock:  # (waits only for a rename under way: then the save is done)
            writing.abandoned = True
        raise
    return target


def _header(data: np.lib.npyio.NpzFile, member: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype that the archive's ``member`` (an ``.npy`` file) declares,
    read from its header alone."""
    with data.zip.open(member) as file:
        version = np.lib.format.read_magic(file)
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise ValueError(f"{member} has .npy format version {version}, not 1.0 to 3.0")
        read = np.lib.format.read_array_header_1_0
        if version != (1, 0):  # (3.0 differs from 2.0 in its header's text encoding only)
            read = np.lib.format.read_array_header_2_0
        shape, _, dtype = read(file)
    return shape, dtype


def _native(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _load(
    path: Path, wanted: Mapping[str, Variable]
) -> tuple[dict[str, np.ndarray], dict[str, tuple], list[str]]:
    """The arrays for the ``wanted`` variables that the file holds with their shape
    and dtype; the shape and dtype of each one it holds (from its header); and the
    names of all it holds. An array of another shape or dtype, and the file's other
    arrays, are never read (an archive is read entry by entry): a damaged header
    declaring a huge shape asked NumPy to allocate it ("Unable to allocate 1.00 TiB")."""
    loaded = np.load(path, allow_pickle=False)
    if not isinstance(loaded, np.lib.npyio.NpzFile):  # a .npy file: one bare array
        raise ValueError("it holds one array (.npy), not named arrays (.npz)")
    with loaded as data:
        # Each array by its exact member name: data[name] would first look for a
        # member called `name`, which for a variable named "a.npy" is variable a's.
        members = set(data.zip.namelist())
        found = {name: _header(data, name + ".npy") for name in wanted if name + ".npy" in members}
        # A file written on a machine of the other byte order holds its arrays in
        # that order ('>f4' for float32): the same values, read in the variable's
        # order (native, unless it was made from an array of the other order).
        stored = {
            name: data[name + ".npy"].astype(wanted[name].dtype, copy=False)
            for name, (shape, dtype) in found.items()
            if shape == wanted[name].shape and _native(dtype) == _native(wanted[name].dtype)
        }
        return stored, found, list(data.files)


async def restore_variables(
    path: str | os.PathLike, variables: Mapping[str, Variable] | Sequence[Variable]
) -> None:
    """Restore ``variables`` from ``path``; every variable must be in the file with its
    shape and dtype, or nothing changes. Names in the file and not asked for are ignored.
    A file that is damaged or not a checkpoint raises ``InvalidArgumentError``."""
    _require_outside_replicas("restore_variables")
    named = _by_name(variables, "restore_variables")
    try:
        stored, found, held = await asyncio.to_thread(_load, Path(path), named)
    except FileNotFoundError:
        raise InvalidArgumentError(f"restore_variables: no checkpoint at {str(path)!r}.") from None
    except MemoryError:
        raise  # (the arrays' shapes are checked first: a real want of memory)
    except Exception as exc:
        # Whatever a damaged file makes zipfile or NumPy raise: BadZipFile,
        # ValueError and OSError mostly, but also NotImplementedError (a compression
        # method byte changed) and RuntimeError (an encryption flag set), which
        # escaped as they were, naming neither the file nor the call.
        raise InvalidArgumentError(
            f"restore_variables: {str(path)!r} is not a checkpoint that save_variables "
            f"wrote (an .npz file): {type(exc).__name__}: {exc}"
        ) from exc
    problems = []
    for name, variable in named.items():
        if name not in found:
            problems.append(f"{name!r} is not in the checkpoint")
        elif name not in stored:
            shape, dtype = found[name]
            problems.append(
                f"{name!r} is {dtype}{list(shape)} in the checkpoint "
                f"but {variable.dtype}{list(variable.shape)} here"
            )
    if problems:
        raise InvalidArgumentError(
            f"restore_variables from {str(path)!r}: {'; '.join(problems)}. Nothing was "
            f"restored. The checkpoint holds: {', '.join(sorted(held)) or 'nothing'}."
        )
    for name, variable in named.items():
        variable._restore(stored[name])
