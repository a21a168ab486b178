"""Type stub of the Rust extension ``qevolve_cli._core`` (hand-written; checked by tests/check_stub.py).

Array arguments are Arrow arrays: objects with ``__arrow_c_array__`` (e.g.
``pyarrow.Array``) or with ``__arrow_c_stream__`` of one chunk (a rechunked
``polars.Series``); results are :class:`ArrowExport` objects that
``pyarrow.array(x)`` or Polars consume zero-copy (once).
"""
from typing import Any, Protocol

__version__: str

class _CArray(Protocol):
    def __arrow_c_array__(self, requested_schema: Any = ...) -> tuple[Any, Any]: ...

class _CStream(Protocol):
    def __arrow_c_stream__(self, requested_schema: Any = ...) -> Any: ...

class _CSchema(Protocol):
    def __arrow_c_schema__(self) -> Any: ...

_ArrowArray = _CArray | _CStream

class CoreDataError(ValueError):
    """Invalid input to the data core (bad offsets, lengths, rules, gamma...)."""

class ArrowExport:
    def __arrow_c_array__(self, requested_schema: Any = None) -> tuple[Any, Any]: ...
    def __len__(self) -> int: ...

class ArrowSchemaExport:
    def __arrow_c_schema__(self) -> Any: ...
    def metadata(self) -> dict[str, str]:
        """The schema's top-level key-value metadata."""

def schema_with_metadata(schema: _CSchema, metadata: dict[str, str]) -> ArrowSchemaExport:
    """``schema`` (a struct schema, e.g. ``polars.Schema``) with its key-value metadata replaced."""

def parse_action(text: str) -> str | None:
    """Command after the last ``Action:`` (to end of line, trimmed); None on a format error."""

def parse_actions(actions: _ArrowArray) -> ArrowExport:
    """Vectorised :func:`parse_action` over a string array (nulls for format errors)."""

def offsets_from_ids(ids: _ArrowArray) -> ArrowExport:
    """int64 offsets (n_traj + 1) of the runs of equal trajectory ids."""

def step_order_offsets(ids: _ArrowArray, step: _ArrowArray) -> ArrowExport | None:
    """int64 offsets (n_traj + 1) when every trajectory's rows are adjacent with steps 0, 1, 2, ...
    (``step`` int32, no nulls in either); ``None`` otherwise."""

def broadcast_bool(offsets: _ArrowArray, per_traj: _ArrowArray) -> ArrowExport:
    """bool per row: each trajectory's value (``per_traj``, one per trajectory) repeated over its rows."""

def trajectory_success(offsets: _ArrowArray, reward_env: _ArrowArray) -> ArrowExport:
    """bool per trajectory: its summed environment reward is non-zero."""

def step_weights(
    offsets: _ArrowArray, success: _ArrowArray, n_rows: int, temporal: bool = True, success_term: bool = True
) -> ArrowExport:
    """float32 w_t = (t/T + d) * 0.5 + 0.5 for every row (terms switchable)."""

def gae_advantages(
    offsets: _ArrowArray,
    reward: _ArrowArray,
    value: _ArrowArray,
    next_value: _ArrowArray,
    done: _ArrowArray,
    gamma: float,
    lam: float,
    reward_aux: _ArrowArray | None = None,
) -> ArrowExport:
    """float32 GAE advantages over ragged trajectories."""

def gigpo_advantages(
    offsets: _ArrowArray,
    group: _ArrowArray,
    reward: _ArrowArray,
    observation: _ArrowArray,
    gamma: float,
    omega: float,
    eps: float,
    norm: str,
    episode_stats: str,
) -> tuple[ArrowExport, ArrowExport, ArrowExport, ArrowExport]:
    """GiGPO (advantage, null outside the episode groups; episode term; step term; uint32 anchor-group size,
    0 outside). ``group``: int64 per trajectory, < 0 = in no group; ``norm``: std | mean; ``episode_stats``:
    trajectories | steps."""

def label_steps(
    action: _ArrowArray,
    observation: _ArrowArray,
    next_observation: _ArrowArray,
    env_code: _ArrowArray,
    rules: list[dict[str, Any]],
) -> tuple[ArrowExport, ArrowExport]:
    """(reward_aux float32, aux_kind str) per row; ``rules[env_code[i]]`` labels row i."""

class PrefixIndexer:
    """A tokenizer (``tokenizer.json``) loaded once; tokenises rendered transcripts in parallel."""

    def __init__(self, tokenizer_json: str) -> None: ...
    def index(
        self, texts: _ArrowArray, char_ends: _ArrowArray, end_offsets: _ArrowArray
    ) -> tuple[ArrowExport, ArrowExport, ArrowExport]:
        """(positions int32 per prefix end, -1 where unchecked; seq_len int32 per text; ok bool per text)."""
    def encode(self, texts: _ArrowArray) -> ArrowExport:
        """list<int32> token ids per text (no special tokens added)."""
    def encode_lengths(self, texts: _ArrowArray) -> ArrowExport:
        """int32 token count per text."""
