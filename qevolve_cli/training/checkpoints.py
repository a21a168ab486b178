"""Checkpoints of the training loop: write, commit atomically, check, load (every rank calls them).

Layout, in a stage's work-in-progress directory ``OUT.partial/`` (:func:`qevolve_cli.atomic.partial_dir`):
``stepNNNNNNNN/`` holds one checkpoint (the loop's: the backend's state, one RNG file per rank,
``state.pt``, ``extra.safetensors``); ``checkpoint.json`` (:data:`POINTER`, replaced atomically and
listing every file with its size) says which one is committed. A kill at any moment leaves the
previous checkpoint or the new one, both whole. The critic writes its own state (two optimisers, see
``critic/trainer.py``) through the same functions and the same pointer name.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError

KILL_AFTER_CHECKPOINT = "QEVOLVE_KILL_AFTER_CHECKPOINT"
POINTER = "checkpoint.json"  # the file that commits a checkpoint (the policy's and the critic's)


def checkpoint_tag(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict[str, Any]:
    """This process's python / numpy / torch (and CUDA) RNG states, loadable with ``weights_only``."""
    import numpy as np
    import torch

    kind, key, pos, has_gauss, gauss = np.random.get_state()
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                          "numpy": (kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    kind, key, pos, has_gauss, gauss = st["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (a checkpoint is committed only once its files are on disk).

    Every rank calls it while rank 0 may still be renaming an atomic write's temporary file into place: a file
    that is gone by the time it is opened was such a temporary (fsynced by its writer before the rename), and is
    skipped (a ZeRO-3 run's rank 1 once failed here with 'No such file' on rank 0's '.tmp...')."""
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            try:
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            except FileNotFoundError:
                continue


def start_checkpoint(ckpt_dir: Path, tag: str, is_main: bool) -> Path:
    """The (empty) directory of checkpoint ``tag``; one left by an attempt that died before committing it is
    cleared first (rank 0; the caller then waits for it on a barrier)."""
    tag_dir = Path(ckpt_dir) / tag
    if is_main:
        shutil.rmtree(tag_dir, ignore_errors=True)
        tag_dir.mkdir(parents=True)
    return tag_dir


def checkpoint_manifest(tag_dir: Path) -> dict[str, int]:
    """Every file of a checkpoint directory -> its size in bytes (written into the pointer that commits it)."""
    tag_dir = Path(tag_dir)
    return {str(f.relative_to(tag_dir)): f.stat().st_size for f in sorted(tag_dir.rglob("*")) if f.is_file()}


def commit_checkpoint(ckpt_dir: Path, pointer: str, meta: dict[str, Any]) -> None:
    """Make ``meta["tag"]`` THE checkpoint: replace the pointer file atomically, then remove the other
    ``step*`` directories (the previous checkpoint, uncommitted leftovers). A kill at any moment leaves
    either the previous checkpoint or the new one, both complete. The pointer lists the checkpoint's
    files and sizes (``files``): a resume reads a checkpoint only when all of them are there
    (:func:`check_checkpoint_files`). Rank 0 only, after every rank has written and fsynced its files."""
    from qevolve_cli.atomic import write_json

    meta = {**meta, "files": checkpoint_manifest(Path(ckpt_dir) / str(meta["tag"]))}
    write_json(Path(ckpt_dir) / pointer, meta)
    for d in Path(ckpt_dir).glob("step*"):
        if d.name != meta["tag"] and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def read_checkpoint_pointer(ckpt_dir: Path, pointer: str = POINTER,
                            needs: tuple[str, ...] = ("epoch", "epoch_step", "step")) -> dict[str, Any] | None:
    """The committed checkpoint's pointer (None when there is none); one-line errors for a broken one: an
    unreadable or half-written pointer, one without the fields ``needs``, a checkpoint directory or file it
    lists that is missing or of another size (:func:`check_checkpoint_files`)."""
    p = Path(ckpt_dir) / pointer
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError):
        raise QevolveError(f"{p}: unreadable checkpoint pointer; delete {ckpt_dir} to start over") from None
    if not isinstance(meta, dict) or "tag" not in meta:
        raise QevolveError(f"{ckpt_dir}: checkpoint of an older qevolve version (no tag); delete it to start over")
    lacking = [k for k in needs if k not in meta]
    if lacking:
        raise QevolveError(f"{p}: field {lacking[0]}: missing from the checkpoint pointer; delete {ckpt_dir} to "
                           "start over")
    check_checkpoint_files(Path(ckpt_dir), meta)
    return meta


def check_checkpoint_files(ckpt_dir: Path, meta: dict[str, Any]) -> None:
    """The committed checkpoint ``meta["tag"]`` is whole: its directory exists and every file the pointer lists
    (``files``: pointers written before qevolve listed them are taken as they are) has its recorded size."""
    tag_dir = Path(ckpt_dir) / str(meta["tag"])
    if not tag_dir.is_dir():
        raise QevolveError(f"{ckpt_dir}: the committed checkpoint {meta['tag']} is missing; delete it to start over")
    files = meta.get("files")
    if files is None:
        return
    if not isinstance(files, dict):
        raise QevolveError(f"{ckpt_dir}: field files: not a file list in the checkpoint pointer; delete it to start over")
    for rel, size in files.items():
        f = tag_dir / rel
        try:
            have = f.stat().st_size
        except OSError:
            raise QevolveError(f"{ckpt_dir}: the committed checkpoint {meta['tag']} is incomplete ({rel} is missing: "
                               "another process may be writing or removing it); delete it to start over") from None
        if have != size:
            raise QevolveError(f"{ckpt_dir}: the committed checkpoint {meta['tag']} is incomplete ({rel} has {have} "
                               f"bytes, the pointer says {size}); delete it to start over")


def check_checkpoint_backend(ckpt_dir: Path, meta: dict[str, Any], backend) -> None:
    """A checkpoint resumes under the backend that wrote it: DeepSpeed ones with the same ranks and ZeRO stage."""
    kind = getattr(backend, "checkpoint_kind", "torch")
    if meta.get("backend", "torch") != kind:
        raise QevolveError(f"{ckpt_dir}: the checkpoint was written by a {meta.get('backend', 'torch')} run, this is a "
                           f"{kind} run; resume with the same command (or delete it to start over)")
    if kind == "deepspeed":
        have = (int(meta.get("world_size", 0)), int(meta.get("zero_stage", -1)))
        if have != (backend.world_size, backend.stage):
            raise QevolveError(f"{ckpt_dir}: the checkpoint was written by {have[0]} ranks with ZeRO-{have[1]}, this run "
                               f"has {backend.world_size} with ZeRO-{backend.stage}; resume with the same launch "
                               "(or delete it to start over)")


def checkpoint_meta(backend) -> dict[str, Any]:
    kind = getattr(backend, "checkpoint_kind", "torch")
    meta: dict[str, Any] = {"backend": kind}
    if kind == "deepspeed":
        meta.update(world_size=backend.world_size, zero_stage=backend.stage)
    return meta


def kill_after_checkpoint(step: int, ckpt_dir: Path) -> None:
    """Fault injection for the recovery tests: with ``QEVOLVE_KILL_AFTER_CHECKPOINT=K`` in the environment the
    process SIGKILLs itself right after the checkpoint of step K is committed (every rank does: a node lost);
    ``NAME:K`` only when the checkpoint directory is named NAME (``policy.partial``: one stage of a run)."""
    want = os.environ.get(KILL_AFTER_CHECKPOINT)
    if want is None:
        return
    name, _, k = want.rpartition(":")
    if k == str(step) and (not name or Path(ckpt_dir).name == name):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def write_checkpoint(backend, ckpt_dir: Path, model, optimizer, scheduler, pos: dict[str, int],
                     extra: dict[str, Any] | None = None, fingerprint: str | None = None,
                     final: bool = False) -> None:
    """Checkpoint of the loop at ``pos`` (``epoch``, ``epoch_step``: steps done in it, ``step``: global);
    collective: every rank calls it. ``final``: the checkpoint after the very last optimiser step, which
    nothing trains from again: the backend leaves the optimiser state out (two fp32 copies of the
    trainable weights under AdamW, the bulk of a full-weight checkpoint; DeepSpeed's ZeRO shards of
    them), and the pointer says so (``weights_only``).

    ``ckpt_dir/stepNNNNNNNN/`` gets the backend's state (:meth:`TorchBackend.save_state`,
    :meth:`DeepSpeedBackend.save_state`), one RNG file per rank, and from rank 0 ``state.pt``
    (scheduler, position) and ``extra.safetensors`` (the caller's tensors: pi_old / pi_ref log-probs);
    every rank fsyncs, all wait, then rank 0 commits it (:func:`commit_checkpoint`).
    """
    import torch
    from safetensors.torch import save_file

    tag = checkpoint_tag(pos["step"])
    tag_dir = start_checkpoint(Path(ckpt_dir), tag, backend.is_main)
    backend.barrier()
    backend.save_state(tag_dir, model, None if final else optimizer)
    torch.save(rng_state(), tag_dir / f"rng_rank{backend.rank}.pt")
    if backend.is_main:
        torch.save({"scheduler": scheduler.state_dict(), **pos}, tag_dir / "state.pt")
        tensors = {k: v for k, v in (extra or {}).items() if isinstance(v, torch.Tensor)}
        if tensors:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tag_dir / "extra.safetensors"))
    fsync_tree(tag_dir)
    backend.barrier()
    if backend.is_main:
        commit_checkpoint(Path(ckpt_dir), POINTER, {"tag": tag, **pos, **checkpoint_meta(backend),
                                                        "fingerprint": fingerprint, "weights_only": final})
    backend.barrier()
    kill_after_checkpoint(pos["step"], ckpt_dir)


def load_checkpoint(backend, ckpt_dir: Path, meta: dict[str, Any], model, optimizer,
                    scheduler) -> tuple[dict[str, int], dict[str, Any]]:
    """Load the committed checkpoint ``meta`` -> (position, extra tensors); every rank calls it."""
    import torch
    from safetensors.torch import load_file

    tag_dir = Path(ckpt_dir) / meta["tag"]
    # a final checkpoint has no optimiser state: the loop resumes past its last step and trains nothing
    backend.load_state(tag_dir, model, None if meta.get("weights_only") else optimizer)
    st = torch.load(tag_dir / "state.pt", map_location="cpu", weights_only=True)
    scheduler.load_state_dict(st["scheduler"])
    for g, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        g["lr"] = lr  # the LR of the next step (DeepSpeed's optimiser state need not carry it)
    rng = tag_dir / f"rng_rank{backend.rank}.pt"
    set_rng_state(torch.load(rng if rng.is_file() else tag_dir / "rng_rank0.pt", weights_only=True))
    extra = load_file(str(tag_dir / "extra.safetensors")) if (tag_dir / "extra.safetensors").exists() else {}
    return {k: int(st[k]) for k in ("epoch", "epoch_step", "step")}, extra


def remove_checkpoint(ckpt_dir: Path | None) -> None:
    if ckpt_dir is not None and Path(ckpt_dir).exists():
        shutil.rmtree(ckpt_dir, ignore_errors=True)
