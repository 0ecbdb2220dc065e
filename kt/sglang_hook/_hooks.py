"""The hooks kt registers in SGLang's HookRegistry (SGLang 0.5.23).

- AROUND ``ServerArgs.add_cli_args``: add the ``--kt-*`` flags SGLang does not declare itself.
- AFTER ``ServerArgs.from_cli_args``: validate every kt value at launch, and store them all on the
  record as ``server_args._kt_options`` (a plain dict). ServerArgs keeps only its declared fields;
  underscore attributes survive pickling, which is how the values reach the scheduler processes.
- REPLACE ``kt_ep_wrapper.create_kt_config_from_server_args``: kt takes over a MoE layer when a
  weight directory or a GPU-expert choice is given (upstream: only with ``--kt-weight-path``).
- REPLACE ``kt_ep_wrapper.KTEPWrapperMethod`` with kt's subclass (``_method.KTMoEMethod``), so
  ``FusedMoE.__init__`` builds kt's method, and ``isinstance`` checks in SGLang's models still hold.
"""
from __future__ import annotations

import logging

from ._flags import KTArgumentError, KTOptions, model_info_from_config, options_from_namespace, \
    read_model_info, validate

logger = logging.getLogger("kt.sglang_hook")

_SA = "sglang.srt.server_args.ServerArgs"
_KTW = "sglang.srt.layers.moe.kt_ep_wrapper"


def _add_cli_args(original, parser):
    from ._flags import add_flags

    result = original(parser)
    add_flags(parser, only_missing=True)
    return result


def _from_cli_args(server_args, cls, args):
    opts = options_from_namespace(args)
    if opts.active:
        model = read_model_info(getattr(server_args, "model_path", None))
        for note in validate(opts, model):
            logger.info("kt: %s", note)
        if opts.stats_path is not None and getattr(server_args, "init_expert_location", "trivial") != "trivial":
            # kt reads the statistics for its own placement; SGLang's EPLB would otherwise permute the
            # experts from the same file.
            server_args.init_expert_location = "trivial"
            logger.info("kt: --init-expert-location %s is read as kt's activation statistics; SGLang's "
                        "own expert location stays trivial", opts.stats_path)
        _no_cuda_graphs(server_args)
    else:
        validate(opts, None)
    server_args._kt_options = opts.to_dict()
    return server_args


def _no_cuda_graphs(server_args) -> None:
    """kt's CPU part runs from a service thread that SGLang's CUDA-graph runners do not drive yet, so a
    captured graph would skip it: graphs are turned off unless the user asked for them explicitly."""
    for name in ("cuda_graph_backend_decode", "cuda_graph_backend_prefill"):
        if not hasattr(server_args, name):
            continue
        v = getattr(server_args, name)
        if v is None:
            setattr(server_args, name, "disabled")
        elif str(v) != "disabled":
            flag = "--" + name.replace("_", "-")
            raise KTArgumentError(f"{flag} {v}: kt's CPU experts cannot run inside SGLang's CUDA graphs yet; "
                                  f"use {flag} disabled (the default with kt)")
    logger.info("kt: SGLang's CUDA graphs are disabled (kt's CPU experts run outside them)")


def current_options(server_args) -> KTOptions:
    """The kt options of this process: the dict stored at launch, or (a ServerArgs built without the
    command line, e.g. ``sglang.Engine(...)``) upstream's declared fields with kt's defaults."""
    d = getattr(server_args, "_kt_options", None)
    if isinstance(d, dict):
        return KTOptions.from_dict(d)
    return options_from_namespace(server_args)


def _model_info(server_args):
    info = None
    try:
        info = read_model_info(getattr(server_args, "model_path", None))
    except KTArgumentError:
        raise
    except Exception:  # noqa: BLE001 - a hub id or an unreadable path: try SGLang's model config
        info = None
    if info is not None:
        return info
    try:
        from sglang.srt.arg_groups.overrides import model_config_of

        cfg = model_config_of(server_args).hf_config
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
        return model_info_from_config(d)
    except Exception:  # noqa: BLE001 - no model config (tests with a dummy model): the layer decides
        return None


def _create_kt_config(server_args, layer_idx):
    from sglang.srt.runtime_context import get_schedule

    from ._method import KTLayerConfig

    opts = current_options(server_args)
    if not opts.active:
        return None
    model = _model_info(server_args)
    try:
        chunk = get_schedule().chunked_prefill_size
    except Exception:  # noqa: BLE001
        chunk = None
    return KTLayerConfig(
        layer_idx=layer_idx, num_gpu_experts=opts.kt_num_gpu_experts or 0,
        cpuinfer_threads=opts.kt_cpuinfer, threadpool_count=opts.kt_threadpool_count,
        weight_path=opts.kt_weight_path, chunked_prefill_size=chunk,
        max_deferred_experts_per_token=opts.kt_max_deferred_experts_per_token, method=opts.kt_method,
        num_layers=model.num_layers if model else None, options=opts.to_dict(), model=model)


def install() -> None:
    """Register kt's hooks (SGLang's ``load_plugins`` applies them after every plugin ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from ._method import KTMoEMethod

    HookRegistry.register(f"{_SA}.add_cli_args", _add_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_SA}.from_cli_args", _from_cli_args, HookType.AFTER)
    HookRegistry.register(f"{_KTW}.create_kt_config_from_server_args", _create_kt_config, HookType.REPLACE)
    HookRegistry.register(f"{_KTW}.KTEPWrapperMethod", KTMoEMethod, HookType.REPLACE)
