"""The ``--kt-*`` command-line flags of the SGLang plugin and of ``kt run``: definitions, parsing and
validation. Pure Python (argparse, numpy through kt.placement); nothing here imports sglang.

Three groups of flags, all reaching every SGLang process:

- upstream SGLang's six (``--kt-weight-path``, ``--kt-method``, ``--kt-cpuinfer``,
  ``--kt-threadpool-count``, ``--kt-num-gpu-experts``, ``--kt-max-deferred-experts-per-token``):
  declared by SGLang itself, so they are ServerArgs fields; kt only validates them;
- the kvcache-ai fork's names users already type (``--kt-numa-nodes``, ``--kt-gpu-experts-ratio``,
  ``--kt-gpu-prefill-token-threshold``, ``--kt-enable-dynamic-expert-update``,
  ``--kt-expert-placement-strategy``, ``--record-kt-gpu-expert-distribution``) and SGLang's own
  ``--init-expert-location`` (which kt reads as activation statistics when kt is active);
- kt's own ``--kt-placement PATH`` and ``--kt-gpu-expert-budget BYTES``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..config import QuantScheme

__all__ = ["FLAGS", "UPSTREAM_FLAGS", "KTOptions", "KTArgumentError", "add_flags", "options_from_namespace",
           "validate", "method_scheme", "METHODS", "STRATEGIES", "parse_threshold", "parse_numa_nodes",
           "ModelInfo", "read_model_info", "model_info_from_config",
           "resolve_placement", "default_threads"]


class KTArgumentError(ValueError):
    """A ``--kt-*`` value that cannot work; the message names the flag, what was expected and found."""


# kt-kernel / SGLang method names -> kt scheme. None: "whatever the kt weight directory holds"
# (kt converts FP8 and GGUF checkpoints to int8/int4/bf16 with `kt convert`).
METHODS: dict[str, QuantScheme | None] = {
    "AMXINT8": QuantScheme.INT8, "INT8": QuantScheme.INT8, "MOE_INT8": QuantScheme.INT8,
    "AMXINT4": QuantScheme.INT4, "INT4": QuantScheme.INT4, "MOE_INT4": QuantScheme.INT4,
    "RAWINT4": QuantScheme.INT4,
    "BF16": QuantScheme.BF16, "AMXBF16": QuantScheme.BF16,
    "FP8": None, "LLAMAFILE": None,
}
UPSTREAM_METHOD_DEFAULT = "AMXINT4"
STRATEGIES = ("uniform", "frequency", "front-loading", "random")


def method_scheme(method: str) -> QuantScheme | None:
    """The kt scheme of a ``--kt-method`` name (case-insensitive); KTArgumentError if unknown."""
    key = str(method).strip().upper()
    if key not in METHODS:
        raise KTArgumentError(f"--kt-method {method!r} is not known; expected one of {sorted(METHODS)}")
    return METHODS[key]


def parse_threshold(text):
    """``--kt-gpu-prefill-token-threshold``: a positive int or 'auto'."""
    if text is None or isinstance(text, int) and not isinstance(text, bool):
        v = text
    elif str(text).strip().lower() == "auto":
        return "auto"
    else:
        try:
            v = int(str(text).strip())
        except ValueError:
            raise KTArgumentError(f"--kt-gpu-prefill-token-threshold: expected a positive integer or "
                                  f"'auto', got {text!r}") from None
    if v is not None and v < 1:
        raise KTArgumentError(f"--kt-gpu-prefill-token-threshold: expected a positive integer or 'auto', "
                              f"got {v}")
    return v


def parse_numa_nodes(text) -> tuple[int, ...] | None:
    """``--kt-numa-nodes``: NUMA node ids, e.g. '0', '0,1' or '0-3'."""
    if text is None:
        return None
    if isinstance(text, (list, tuple)):
        return tuple(int(v) for v in text)
    s = str(text).strip()
    try:
        out: list[int] = []
        for part in s.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise KTArgumentError(f"--kt-numa-nodes: expected node ids such as '0', '0,1' or '0-3', "
                              f"got {text!r}") from None
    if any(v < 0 for v in out) or len(set(out)) != len(out):
        raise KTArgumentError(f"--kt-numa-nodes: node ids must be distinct and >= 0, got {text!r}")
    return tuple(out)


def _ratio(text):
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise KTArgumentError(f"--kt-gpu-experts-ratio: expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < v <= 1.0:
        raise KTArgumentError(f"--kt-gpu-experts-ratio: expected a number in (0, 1], got {v}")
    return v


def _bytes(text):
    from ..placement import parse_bytes

    try:
        return parse_bytes(text if not str(text).strip().isdigit() else int(str(text).strip()))
    except (TypeError, ValueError) as exc:
        raise KTArgumentError(f"--kt-gpu-expert-budget: {exc}") from None


def _argparse_type(fn):
    """Wrap a parser so argparse shows its message (argparse only keeps ArgumentTypeError text)."""
    import argparse

    def conv(text):
        try:
            return fn(text)
        except KTArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None

    conv.__name__ = getattr(fn, "__name__", "value")
    return conv


@dataclass(frozen=True)
class Flag:
    """One command-line flag: ``dest`` is the ServerArgs field / KTOptions attribute."""

    name: str
    dest: str
    kwargs: dict = field(default_factory=dict)
    upstream: bool = False  # declared by SGLang 0.5.23 itself


def _flags() -> tuple[Flag, ...]:
    T = _argparse_type
    return (
        Flag("--kt-weight-path", "kt_weight_path", dict(
            type=str, default=None, metavar="DIR",
            help="[kt] kt weight directory of the CPU experts (from `kt convert`). Without it, kt converts "
                 "the experts the model checkpoint provides while loading (slower start, more RAM)."),
             upstream=True),
        Flag("--kt-method", "kt_method", dict(
            type=str, default=UPSTREAM_METHOD_DEFAULT, metavar="METHOD",
            help=f"[kt] CPU expert format: {', '.join(sorted(METHODS))} (AMXINT8 -> int8, AMXINT4 -> int4, "
                 "BF16 -> bf16; FP8/LLAMAFILE take the weight directory's scheme)."), upstream=True),
        Flag("--kt-cpuinfer", "kt_cpuinfer", dict(
            type=int, default=None, metavar="N", help="[kt] CPU threads for the CPU experts."), upstream=True),
        Flag("--kt-threadpool-count", "kt_threadpool_count", dict(
            type=int, default=2, metavar="N",
            help="[kt] thread pools (one per NUMA node)."), upstream=True),
        Flag("--kt-num-gpu-experts", "kt_num_gpu_experts", dict(
            type=int, default=None, metavar="N",
            help="[kt] GPU experts per MoE layer (placement per --kt-expert-placement-strategy)."),
             upstream=True),
        Flag("--kt-max-deferred-experts-per-token", "kt_max_deferred_experts_per_token", dict(
            type=int, default=None, metavar="N",
            help="[kt] per token, this many of its lowest-weight CPU experts finish during the next "
                 "layer (the last MoE layer defers none)."), upstream=True),
        Flag("--kt-numa-nodes", "kt_numa_nodes", dict(
            type=T(parse_numa_nodes), default=None, metavar="NODES",
            help="[kt] NUMA node ids for the CPU experts, e.g. '0,1' or '0-3'.")),
        Flag("--kt-gpu-experts-ratio", "kt_gpu_experts_ratio", dict(
            type=T(_ratio), default=None, metavar="R",
            help="[kt] fraction (0, 1] of all routed experts to put on the GPU.")),
        Flag("--kt-gpu-prefill-token-threshold", "kt_gpu_prefill_token_threshold", dict(
            type=T(parse_threshold), default=None, metavar="N|auto",
            help="[kt] batches of at least N tokens run every expert of a layer on the GPU (layer-wise "
                 "prefill); 'auto' picks N from a cost model.")),
        Flag("--kt-enable-dynamic-expert-update", "kt_enable_dynamic_expert_update", dict(
            action="store_true", default=False,
            help="[kt] re-place hot experts on the GPU from routing statistics while serving.")),
        Flag("--kt-expert-placement-strategy", "kt_expert_placement_strategy", dict(
            type=str, default="uniform", choices=list(STRATEGIES),
            help="[kt] which experts go to the GPU (frequency needs --init-expert-location).")),
        Flag("--init-expert-location", "init_expert_location", dict(
            type=str, default="trivial", metavar="PATH",
            help="Activation statistics (SGLang .pt with logical_count, or kt .npz/.json); with kt active "
                 "they drive kt's placement."), upstream=True),
        Flag("--record-kt-gpu-expert-distribution", "record_kt_gpu_expert_distribution", dict(
            nargs="?", const="kt_expert_stats.npz", default=None, metavar="PATH",
            help="[kt] record routing statistics and save them at exit to PATH (.npz/.json; default "
                 "kt_expert_stats.npz); feed them back with --init-expert-location.")),
        Flag("--kt-placement", "kt_placement", dict(
            type=str, default=None, metavar="PATH",
            help="[kt] a saved placement (`kt placement plan`): exactly which experts go to the GPU.")),
        Flag("--kt-gpu-expert-budget", "kt_gpu_expert_budget", dict(
            type=T(_bytes), default=None, metavar="BYTES",
            help="[kt] GPU memory for routed experts, e.g. 24GiB.")),
    )


FLAGS: tuple[Flag, ...] = _flags()
UPSTREAM_FLAGS = tuple(f for f in FLAGS if f.upstream)


def add_flags(parser, *, only_missing: bool = True) -> list[str]:
    """Add the kt flags to an argparse parser; with ``only_missing`` skip names it already defines
    (SGLang declares the upstream ones). Returns the flag names added."""
    existing = set(getattr(parser, "_option_string_actions", {}))
    added = []
    for f in FLAGS:
        if only_missing and f.name in existing:
            continue
        parser.add_argument(f.name, dest=f.dest, **f.kwargs)
        added.append(f.name)
    return added


@dataclass(frozen=True)
class KTOptions:
    """Every kt flag's value (after parsing). A plain record: it travels to SGLang's subprocesses as a
    dict (``to_dict``) on the pickled ServerArgs."""

    kt_weight_path: str | None = None
    kt_method: str = UPSTREAM_METHOD_DEFAULT
    kt_cpuinfer: int | None = None
    kt_threadpool_count: int = 2
    kt_num_gpu_experts: int | None = None
    kt_max_deferred_experts_per_token: int | None = None
    kt_numa_nodes: tuple[int, ...] | None = None
    kt_gpu_experts_ratio: float | None = None
    kt_gpu_prefill_token_threshold: int | str | None = None
    kt_enable_dynamic_expert_update: bool = False
    kt_expert_placement_strategy: str = "uniform"
    init_expert_location: str = "trivial"
    record_kt_gpu_expert_distribution: str | None = None
    kt_placement: str | None = None
    kt_gpu_expert_budget: int | None = None

    @property
    def active(self) -> bool:
        """kt takes over the MoE layers when a weight directory or any GPU-expert choice is given."""
        return any(v is not None for v in (self.kt_weight_path, self.kt_num_gpu_experts,
                                           self.kt_gpu_experts_ratio, self.kt_gpu_expert_budget,
                                           self.kt_placement))

    @property
    def stats_path(self) -> str | None:
        v = self.init_expert_location
        return None if v in (None, "", "trivial") else v

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["kt_numa_nodes"] is not None:
            d["kt_numa_nodes"] = list(d["kt_numa_nodes"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KTOptions":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if kw.get("kt_numa_nodes") is not None:
            kw["kt_numa_nodes"] = tuple(kw["kt_numa_nodes"])
        return cls(**kw)


def options_from_namespace(ns) -> KTOptions:
    """KTOptions from an argparse Namespace or a ServerArgs-like object (missing names: defaults)."""
    kw = {}
    for f in fields(KTOptions):
        if hasattr(ns, f.name):
            kw[f.name] = getattr(ns, f.name)
    if kw.get("kt_numa_nodes") is not None and not isinstance(kw["kt_numa_nodes"], tuple):
        kw["kt_numa_nodes"] = parse_numa_nodes(kw["kt_numa_nodes"])
    if isinstance(kw.get("kt_gpu_prefill_token_threshold"), str):
        kw["kt_gpu_prefill_token_threshold"] = parse_threshold(kw["kt_gpu_prefill_token_threshold"])
    return KTOptions(**kw)


# ----------------------------------------------------------------------------- the model

@dataclass(frozen=True)
class ModelInfo:
    """What kt needs to know of a MoE model: L decoder layers, E routed experts, K top-k, H, I, and
    which decoder layers have routed experts."""

    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    moe_layers: tuple[int, ...]
    model_type: str | None = None


_E_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_I_KEYS = ("moe_intermediate_size", "expert_intermediate_size")


def model_info_from_config(cfg: dict) -> ModelInfo | None:
    """ModelInfo from a Hugging Face config dict; None when it has no routed experts."""
    if isinstance(cfg.get("text_config"), dict) and not any(k in cfg for k in _E_KEYS):
        cfg = {**cfg, **cfg["text_config"]}
    E = next((cfg[k] for k in _E_KEYS if isinstance(cfg.get(k), int)), None)
    if E is None:
        return None
    L = int(cfg.get("num_hidden_layers", 0) or 0)
    H = int(cfg.get("hidden_size", 0) or 0)
    I = next((cfg[k] for k in _I_KEYS if isinstance(cfg.get(k), int)), None)
    if I is None:
        I = int(cfg.get("intermediate_size", 0) or 0)
    K = int(cfg.get("num_experts_per_tok", cfg.get("moe_topk", 0)) or 0)
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    moe = tuple(l for l in range(L) if l >= first_dense and l not in mlp_only
                and (l + 1) % step == 0 and (l - first_dense) % freq == 0)
    return ModelInfo(L, int(E), K, H, int(I), moe, cfg.get("model_type"))


def read_model_info(model_path) -> ModelInfo | None:
    """ModelInfo from ``model_path/config.json`` (a local Hugging Face directory); None when the path
    is not a local directory with a MoE config (a hub id: SGLang resolves it later)."""
    if model_path is None:
        return None
    cfg_path = Path(str(model_path)).expanduser() / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise KTArgumentError(f"{cfg_path}: cannot read the model config ({type(exc).__name__})") from None
    if not isinstance(cfg, dict):
        raise KTArgumentError(f"{cfg_path}: the model config is a JSON {type(cfg).__name__}, expected an "
                              "object")
    return model_info_from_config(cfg)


def resolve_placement(opts: "KTOptions", model: ModelInfo, expert_bytes: int | None = None):
    """The Placement [L, E] the flags ask for (the same in every process: it is a pure function of
    the flags, the files they name and the model). No budget flag: every expert on the CPU."""
    from ..placement import Budget, ExpertStats, Placement, plan

    L, E = model.num_layers, model.num_experts
    if opts.kt_placement is not None:
        try:
            return Placement.load(opts.kt_placement, num_layers=L, num_experts=E)
        except (ValueError, TypeError) as exc:
            raise KTArgumentError(f"--kt-placement: {exc}") from None
    stats = None
    if opts.stats_path is not None:
        try:
            stats = ExpertStats.load(opts.stats_path, num_layers=L, num_experts=E)
        except (ValueError, TypeError) as exc:
            raise KTArgumentError(f"--init-expert-location: {exc}") from None
    if opts.kt_num_gpu_experts is not None:
        if opts.kt_num_gpu_experts > E:
            raise KTArgumentError(f"--kt-num-gpu-experts {opts.kt_num_gpu_experts} exceeds the "
                                  f"{E} experts of a layer")
        budget = Budget.per_layer(opts.kt_num_gpu_experts)
    elif opts.kt_gpu_experts_ratio is not None:
        budget = Budget.ratio(opts.kt_gpu_experts_ratio)
    elif opts.kt_gpu_expert_budget is not None:
        budget = Budget.bytes(opts.kt_gpu_expert_budget)
    else:
        return Placement.all_cpu(L, E)
    if budget.value == 0:
        return Placement.all_cpu(L, E)
    try:
        return plan(stats if stats is not None else (L, E), budget, opts.kt_expert_placement_strategy,
                    expert_bytes=expert_bytes, moe_layers=model.moe_layers or None)
    except ValueError as exc:
        raise KTArgumentError(f"kt placement: {exc}") from None


# ----------------------------------------------------------------------------- validation

def _manifest(path: str) -> dict:
    p = Path(path).expanduser()
    if not p.exists():
        raise KTArgumentError(f"--kt-weight-path {path}: no such directory (convert the model's experts "
                              f"with `kt convert MODEL {path}`)")
    if not p.is_dir():
        raise KTArgumentError(f"--kt-weight-path {path}: not a directory")
    m = p / "manifest.json"
    if not m.is_file():
        raise KTArgumentError(f"--kt-weight-path {path}: no manifest.json, so it is not a kt weight "
                              f"directory (kt-kernel's format is not read; convert with `kt convert`)")
    try:
        return json.loads(m.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KTArgumentError(f"--kt-weight-path {path}: unreadable manifest.json ({exc})") from None


def validate(opts: KTOptions, model: ModelInfo | None = None) -> list[str]:
    """Check every kt value (and, when the model is known, the files against it). Raises
    KTArgumentError naming the flag; returns notes worth logging (e.g. defaults that were replaced)."""
    notes: list[str] = []
    method_scheme(opts.kt_method)
    for name, v, lo in (("--kt-cpuinfer", opts.kt_cpuinfer, 1), ("--kt-threadpool-count",
                                                                  opts.kt_threadpool_count, 1),
                        ("--kt-num-gpu-experts", opts.kt_num_gpu_experts, 0),
                        ("--kt-max-deferred-experts-per-token", opts.kt_max_deferred_experts_per_token, 0)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise KTArgumentError(f"{name}: expected an integer >= {lo}, got {v!r}")
    if opts.kt_gpu_experts_ratio is not None:
        _ratio(opts.kt_gpu_experts_ratio)
    parse_threshold(opts.kt_gpu_prefill_token_threshold)
    if opts.kt_expert_placement_strategy not in STRATEGIES:
        raise KTArgumentError(f"--kt-expert-placement-strategy: expected one of {list(STRATEGIES)}, got "
                              f"{opts.kt_expert_placement_strategy!r}")
    budgets = [n for n, v in (("--kt-num-gpu-experts", opts.kt_num_gpu_experts),
                              ("--kt-gpu-experts-ratio", opts.kt_gpu_experts_ratio),
                              ("--kt-gpu-expert-budget", opts.kt_gpu_expert_budget)) if v is not None]
    if len(budgets) > 1:
        raise KTArgumentError(f"give only one GPU-expert budget; got {' and '.join(budgets)}")
    if opts.kt_placement is not None and budgets:
        raise KTArgumentError(f"--kt-placement fixes the GPU experts exactly; drop {budgets[0]}")
    if opts.kt_expert_placement_strategy == "frequency" and opts.stats_path is None \
            and opts.kt_placement is None:
        raise KTArgumentError("--kt-expert-placement-strategy frequency needs activation statistics: "
                              "--init-expert-location STATS (SGLang .pt or kt .npz/.json)")
    if opts.kt_numa_nodes is not None:
        parse_numa_nodes(opts.kt_numa_nodes)
        have = _numa_node_ids()
        missing = [n for n in opts.kt_numa_nodes if have and n not in have]
        if missing:
            raise KTArgumentError(f"--kt-numa-nodes: node(s) {missing} do not exist on this host "
                                  f"(nodes: {sorted(have)})")
    if not opts.active:
        return notes
    if opts.kt_max_deferred_experts_per_token and model is not None and model.top_k and \
            opts.kt_max_deferred_experts_per_token >= model.top_k:
        raise KTArgumentError(f"--kt-max-deferred-experts-per-token {opts.kt_max_deferred_experts_per_token}"
                              f" must be below the model's top-k ({model.top_k})")
    if opts.kt_weight_path is not None:
        m = _manifest(opts.kt_weight_path)
        have = QuantScheme.parse(m.get("scheme", "?")) if m.get("scheme") in ("int8", "int4", "bf16") else None
        want = method_scheme(opts.kt_method)
        if have is None:
            raise KTArgumentError(f"--kt-weight-path {opts.kt_weight_path}: manifest scheme "
                                  f"{m.get('scheme')!r} is not one of int8/int4/bf16")
        if want is not None and want is not have:
            if opts.kt_method.strip().upper() == UPSTREAM_METHOD_DEFAULT:
                notes.append(f"--kt-method defaults to {UPSTREAM_METHOD_DEFAULT}; using the weight "
                             f"directory's scheme {have.value}")
            else:
                raise KTArgumentError(f"--kt-method {opts.kt_method} means {want.value}, but "
                                      f"{opts.kt_weight_path} holds {have.value} experts")
        if model is not None:
            got = (m.get("num_experts"), m.get("hidden_size"), m.get("intermediate_size"))
            exp = (model.num_experts, model.hidden, model.intermediate)
            if got != exp:
                raise KTArgumentError(f"--kt-weight-path {opts.kt_weight_path}: experts (E, H, I) = {got}, "
                                      f"but the model has {exp}; it was converted from another model")
            missing = sorted(set(model.moe_layers) - set(int(v) for v in m.get("layers", [])))
            if missing:
                raise KTArgumentError(f"--kt-weight-path {opts.kt_weight_path}: MoE layers {missing} are "
                                      "missing (a partial conversion? rerun `kt convert` to finish it)")
    if opts.kt_placement is not None:
        from ..placement import Placement

        if not Path(opts.kt_placement).is_file():
            raise KTArgumentError(f"--kt-placement {opts.kt_placement}: no such file")
        try:
            Placement.load(opts.kt_placement, num_layers=model.num_layers if model else None,
                           num_experts=model.num_experts if model else None)
        except (ValueError, TypeError) as exc:
            raise KTArgumentError(f"--kt-placement: {exc}") from None
    if opts.stats_path is not None:
        from ..placement import ExpertStats

        if not Path(opts.stats_path).is_file():
            raise KTArgumentError(f"--init-expert-location {opts.stats_path}: no such file")
        try:
            ExpertStats.load(opts.stats_path, num_layers=model.num_layers if model else None,
                             num_experts=model.num_experts if model else None)
        except (ValueError, TypeError) as exc:
            raise KTArgumentError(f"--init-expert-location: {exc}") from None
    if opts.record_kt_gpu_expert_distribution is not None:
        suffix = Path(opts.record_kt_gpu_expert_distribution).suffix.lower()
        if suffix not in (".npz", ".json"):
            raise KTArgumentError(f"--record-kt-gpu-expert-distribution: statistics are saved as .npz or "
                                  f".json, got {opts.record_kt_gpu_expert_distribution!r}")
    return notes


def _numa_node_ids() -> set[int]:
    base = Path("/sys/devices/system/node")
    try:
        return {int(p.name[4:]) for p in base.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()}
    except OSError:
        return set()


def default_threads() -> int:
    """CPU threads kt uses by default: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
