"""Wiring for ``gyre serve trainer``: settings and live handles in, a training cell running.

The lead registers ``SPEC`` in ``gyre/services.py``. Options, each read from its
environment variable (``ENV`` below: ``GYRE_TRAINER_<OPTION>``, ``GYRE_MODEL`` for
``model``, ``GYRE_TRAINER_TENSOR_MODEL_PARALLEL_SIZE`` for ``tp``; ``gyre up`` sets them from
the run config, ``run_config_options``; ``gyre serve trainer`` has no command-line options
for them): ``role`` (``core`` | ``satellite``), ``cell``, ``backend`` (``torch`` |
``megatron``), ``model`` (an HF folder or ``tiny-qwen``), ``tp``, ``lr``, ``eps_low``,
``eps_high``, ``tis_cap`` (unset: no truncated importance sampling; ``gyre up``: 2.0),
``kl_coef``, ``max_grad_norm`` (gradient-norm clipping; default 1.0, 0: none),
``attention`` (tree attention: ``auto``, the default, picks by length and device, or
``dense`` | ``flex`` | ``blocks``, ``attention.py``), ``groups_per_step``,
``checkpoint_dir``, ``keep_checkpoints`` (the newest N checkpoints kept; default all, which
``gyre replay --step`` of any step needs), ``keep_weights`` (the newest N published weight
versions whose blobs, and disk-mode folders, are kept; default 3, at least 2: the newest
``WeightsPublished``'s version, which a resuming or joining cell pulls, and the one before,
which a lagging inference cell may still use; ``all`` (or 0) keeps every version; replay
reads checkpoints, not these), ``max_staleness`` (unset: no bound; ``gyre up``: 1),
``ack_wait_s``, ``transfer`` (``blob`` | ``port``: how satellites send gradients; the core
reads either), ``publish_to``
(``cell=url,cell=url``: inference cells to publish weights to), ``publish_mode``
(``tensor`` | ``disk``), ``publish_pause`` (``none`` | ``in_place``: pause generation
around every update; an engine that refuses updates while it generates is paused anyway),
``follow_role`` (core: its own worker claims micro-steps only between its cell's join and
leave requests, ``gate.py``; the core applies updates in every role), ``requeue_after_s``
(core: a micro-step of the current step that no cell finished within this many seconds of
its weights being published, the core reading it or its last claim is computed by the
core; default 0, off: only those the work queue dead-lettered, which the core always
computes; a core computing them would train while its cell serves; ``core.py``), ``max_claims``
(core: a micro-step cells claimed this many times without a result, each cell that took it
having died with it, is computed by the core; default 4, 0 off; ``watchdog.py``), ``resume_behind_log`` (core, ``GYRE_TRAINER_RESUME_BEHIND_LOG=1``:
the operator's override to resume from a checkpoint older than the log's last
``StepApplied``, which the core otherwise refuses: it would train applied steps again and
publish their versions a second time with other bytes). A malformed
``max_grad_norm``, ``attention`` or ``keep_weights`` stops the service at start with an error
that names its variable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from libs.common.options import number_option
from libs.common.service import ServiceContext, ServiceSpec

from .attention import AttentionConfig
from .objective import ObjectiveConfig
from .step import TrainConfig


def _opt(options: dict[str, Any], name: str, cast, default):
    value = options.get(name)
    return default if value is None or value == "" else cast(value)


def run_config_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer options a run config sets (``RunConfig.model_dump()``, or the ``config``
    of ``RunStarted``): what ``gyre up`` passes as ``GYRE_TRAINER_<OPTION>``, and what a
    replay of a step must use to recompute its loss."""
    loss, trainer = config.get("loss") or {}, config.get("trainer") or {}
    pairs = {"backend": trainer.get("backend"), "lr": trainer.get("lr"), "max_staleness": trainer.get("staleness"),
             "eps_low": loss.get("clip_low"), "eps_high": loss.get("clip_high"), "kl_coef": loss.get("kl_coef"),
             "tis_cap": loss.get("tis_cap"), "keep_checkpoints": trainer.get("keep_checkpoints"),
             "keep_weights": trainer.get("keep_weights")}
    return {k: v for k, v in pairs.items() if v is not None}


ENV = {"role": "GYRE_TRAINER_ROLE", "cell": "GYRE_TRAINER_CELL", "backend": "GYRE_TRAINER_BACKEND",
       "model": "GYRE_MODEL", "lr": "GYRE_TRAINER_LR", "publish_to": "GYRE_TRAINER_PUBLISH_TO",
       "groups_per_step": "GYRE_TRAINER_GROUPS_PER_STEP", "checkpoint_dir": "GYRE_TRAINER_CHECKPOINT_DIR",
       "eps_low": "GYRE_TRAINER_EPS_LOW", "eps_high": "GYRE_TRAINER_EPS_HIGH", "tis_cap": "GYRE_TRAINER_TIS_CAP",
       "kl_coef": "GYRE_TRAINER_KL_COEF", "max_staleness": "GYRE_TRAINER_MAX_STALENESS",
       "transfer": "GYRE_TRAINER_TRANSFER", "tp": "GYRE_TRAINER_TENSOR_MODEL_PARALLEL_SIZE",
       "ack_wait_s": "GYRE_TRAINER_ACK_WAIT_S", "publish_mode": "GYRE_TRAINER_PUBLISH_MODE",
       "publish_pause": "GYRE_TRAINER_PUBLISH_PAUSE", "follow_role": "GYRE_TRAINER_FOLLOW_ROLE",
       "keep_checkpoints": "GYRE_TRAINER_KEEP_CHECKPOINTS", "keep_weights": "GYRE_TRAINER_KEEP_WEIGHTS",
       "max_grad_norm": "GYRE_TRAINER_MAX_GRAD_NORM", "attention": "GYRE_TRAINER_ATTENTION",
       "requeue_after_s": "GYRE_TRAINER_REQUEUE_AFTER_S", "resume_behind_log": "GYRE_TRAINER_RESUME_BEHIND_LOG",
       "max_claims": "GYRE_TRAINER_MAX_CLAIMS"}

ATTENTION_MODES = ("auto", "dense", "flex", "blocks")  # attention.Mode


def env_options(options: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``options`` plus each trainer variable of ``ENV`` that is set and not given already
    (how ``gyre up``, compose, Helm and systemd configure a trainer or a cell's satellite)."""
    extra = {k: environ[v] for k, v in ENV.items() if environ.get(v) and k not in options}
    return {**options, **extra}


def keep_weights(options: dict[str, Any]) -> int | None:
    """The ``keep_weights`` option: newest published weight versions kept (None: all)."""
    from .core import DEFAULT_KEEP_WEIGHTS, MIN_KEEP_WEIGHTS

    value = options.get("keep_weights")
    if value is None or value == "":
        return DEFAULT_KEEP_WEIGHTS
    if str(value).strip().lower() in ("all", "0"):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = None
    if n is None or n < MIN_KEEP_WEIGHTS:
        raise ValueError(f"keep_weights (GYRE_TRAINER_KEEP_WEIGHTS) must be a count of at least {MIN_KEEP_WEIGHTS} "
                         f"(the newest published version and the one before it) or 'all', not {value!r}")
    return n


def max_grad_norm(options: dict[str, Any]) -> float:
    """The ``max_grad_norm`` option: the gradient norm an update is clipped to (0: no clipping)."""
    return number_option(options, "max_grad_norm", default=1.0, minimum=0,
                         label="max_grad_norm (GYRE_TRAINER_MAX_GRAD_NORM)",
                         must_be="a finite number >= 0 (0: no clipping)")


def attention_mode(options: dict[str, Any]) -> str:
    """The ``attention`` option: how tree attention is computed (``attention.py``)."""
    value = options.get("attention")
    if value is None or value == "":
        return "auto"
    mode = str(value).strip().lower()
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention (GYRE_TRAINER_ATTENTION) must be one of {', '.join(ATTENTION_MODES)}, "
                         f"not {value!r}")
    return mode


def _flag(options: dict[str, Any], name: str) -> bool:
    return str(_opt(options, name, str, "0")).strip().lower() in ("1", "true", "yes", "on")


def requeue_after_s(options: dict[str, Any]) -> float | None:
    """The ``requeue_after_s`` option: the core's watchdog wait (None: dead letters only)."""
    from .core import DEFAULT_REQUEUE_AFTER_S

    value = number_option(options, "requeue_after_s", default=DEFAULT_REQUEUE_AFTER_S or 0, minimum=0,
                          label="requeue_after_s (GYRE_TRAINER_REQUEUE_AFTER_S)",
                          must_be="a finite number of seconds >= 0 (0: only dead-lettered micro-steps)")
    return value or None


def max_claims(options: dict[str, Any]) -> int | None:
    """The ``max_claims`` option: claims without a result before the core computes a
    micro-step itself (None: off)."""
    from .watchdog import DEFAULT_MAX_CLAIMS

    value = number_option(options, "max_claims", default=DEFAULT_MAX_CLAIMS, minimum=0, integer=True,
                          label="max_claims (GYRE_TRAINER_MAX_CLAIMS)",
                          must_be="a whole number >= 0 (0: off)")
    return value or None


def worker_settings(run_id: str, cell: str, options: dict[str, Any]):
    from .worker import WorkerSettings

    return WorkerSettings(run_id, cell, train_config(options), max_staleness=_opt(options, "max_staleness", int, None),
                          ack_wait_s=_opt(options, "ack_wait_s", float, 600.0))


def satellite_seat(run_id: str, cell: str, options: dict[str, Any], *, bus, blobs):
    """The training seat of a non-core cell: a satellite replica built from the run's
    trainer options (backend, model, objective), sending gradients over the blob store, or
    the shared transfer port with ``transfer: port``."""
    from .seat import SatelliteSeat
    from .transfer import BlobTransfer

    gradients = _port_transfer() if _opt(options, "transfer", str, "blob") == "port" else BlobTransfer(blobs)
    return SatelliteSeat(worker_settings(run_id, cell, options), lambda: build_backend(options), bus, blobs,
                         gradients, warm_up=lambda: _import_model_code(options))


def _import_model_code(options: dict[str, Any]) -> None:
    """The policy's architecture and the trainer's backend imported ahead of the first switch."""
    from services.engine.model_store import import_model_code, resolve_model

    from .backends import torch_hf  # noqa: F401

    import_model_code(resolve_model(_opt(options, "model", str, "tiny-qwen")).folder)


def train_config(options: dict[str, Any]) -> TrainConfig:
    return TrainConfig(
        objective=ObjectiveConfig(eps_low=_opt(options, "eps_low", float, 0.2),
                                  eps_high=_opt(options, "eps_high", float, 0.28),
                                  tis_cap=_opt(options, "tis_cap", float, None),
                                  kl_coef=_opt(options, "kl_coef", float, 0.0)),
        attention=AttentionConfig(mode=attention_mode(options)),
        lr=_opt(options, "lr", float, 1e-5),
        max_grad_norm=max_grad_norm(options),
    )


def build_backend(options: dict[str, Any]):
    """The policy model for this cell (each call builds a separate copy)."""
    from services.engine.model_store import resolve_model

    name = _opt(options, "backend", str, "torch")
    folder = resolve_model(_opt(options, "model", str, "tiny-qwen")).folder
    from .backends.torch_hf import TorchBackend

    hf = TorchBackend.from_pretrained(folder)
    if name == "torch":
        return hf
    if name == "megatron":
        from .backends.megatron import MegatronBackend
        from .backends.torch_hf import TinyModelConfig

        c = hf.model.config
        shape = TinyModelConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
                                num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                rope_theta=_rope_theta(c),
                                rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
                                qkv_bias=bool(getattr(c, "attention_bias", c.model_type == "qwen2")))
        backend = MegatronBackend(shape, tp=_opt(options, "tp", int, 1))
        backend.load_hf_state_dict(hf.hf_state_dict())
        return backend
    raise ValueError(f"unknown trainer backend {name!r} (torch | megatron)")


def _rope_theta(config) -> float:
    """transformers 5 keeps it in ``rope_parameters``; older configs have ``rope_theta``."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {params.get('rope_type')!r} is not converted to megatron yet")
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def _port_transfer():
    """The shared transfer port (Mooncake / UCX; TCP on loopback here) for gradients."""
    from libs.common.transfer.weights import PortTransfer

    return PortTransfer()


def _publisher(options: dict[str, Any], admin_token: str | None, run_dir: Path):
    targets = _opt(options, "publish_to", str, "")
    if not targets:
        return None
    from services.engine.client import EngineClient
    from services.engine.model_store import resolve_model

    from .publish import EnginePublisher

    clients = {}
    for item in targets.split(","):
        cell, _, url = item.partition("=")
        clients[cell.strip()] = EngineClient(url.strip(), admin_token=admin_token)
    folder = resolve_model(_opt(options, "model", str, "tiny-qwen")).folder
    return EnginePublisher(clients, mode=_opt(options, "publish_mode", str, "tensor"),
                           pause=_opt(options, "publish_pause", str, "none"),
                           folder=run_dir / "trainer" / "published", hf_config=folder / "config.json",
                           keep=keep_weights(options))


async def trainer_main(ctx: ServiceContext) -> None:
    from .core import CoreSettings, CoreTrainer, CoreWeightSource
    from .transfer import BlobTransfer, InProcessTransfer, RoutedTransfer
    from .worker import BusWeightSource, MicroStepWorker

    rt, options = ctx.runtime, ctx.options
    run_id, role = rt.settings.run_id, _opt(options, "role", str, "core")
    cell = _opt(options, "cell", str, role)
    train = train_config(options)
    blob = BlobTransfer(rt.blobs)
    port = _port_transfer() if _opt(options, "transfer", str, "blob") == "port" else None
    gradients = port or blob
    settings_w = worker_settings(run_id, cell, options)
    if role == "satellite":
        worker = MicroStepWorker(settings_w, await asyncio.to_thread(build_backend, options), bus=rt.bus,
                                 blobs=rt.blobs, gradients=gradients,
                                 weights=BusWeightSource(rt.bus, rt.blobs, run_id))
        ctx.health.ok(role=role, cell=cell)
        await worker.run(ctx.stop)
        return
    checkpoints = Path(_opt(options, "checkpoint_dir", str, str(rt.settings.run_dir / "trainer" / "checkpoints")))
    local = InProcessTransfer()  # the core's own worker hands its gradients over in memory
    settings = CoreSettings(run_id, cell, train, checkpoints, _opt(options, "groups_per_step", int, None),
                            max_staleness=settings_w.max_staleness,
                            keep_checkpoints=_opt(options, "keep_checkpoints", int, None),
                            keep_weights=keep_weights(options), requeue_after_s=requeue_after_s(options),
                            max_claims=max_claims(options), resume_behind_log=_flag(options, "resume_behind_log"))
    if settings.keep_checkpoints is not None and settings.keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints (GYRE_TRAINER_KEEP_CHECKPOINTS) must be at least 1, "
                         f"not {settings.keep_checkpoints}")
    publisher = _publisher(options, rt.settings.admin_token, rt.settings.run_dir)
    core = CoreTrainer(settings, await asyncio.to_thread(build_backend, options), bus=rt.bus, blobs=rt.blobs,
                       gradients=RoutedTransfer(gradients, memory=local, blob=blob, port=port or _port_transfer()),
                       publish=publisher)
    worker = MicroStepWorker(settings_w, await asyncio.to_thread(build_backend, options), bus=rt.bus,
                             blobs=rt.blobs, gradients=local, weights=CoreWeightSource(core))
    follow = _flag(options, "follow_role")
    ctx.health.ok(role=role, cell=cell, checkpoints=str(checkpoints), follows_role=follow)
    if follow:  # the core's own worker claims only while its cell trains (gate.py)
        from .gate import run_gated

        own_work = run_gated(worker, rt.bus, run_id, cell, ctx.stop)
    else:
        own_work = worker.run(ctx.stop)
    try:
        await asyncio.gather(core.run(ctx.stop), own_work)
    finally:
        if publisher is not None:
            await publisher.close()
            for client in publisher.clients.values():
                await client.aclose()


SPEC = ServiceSpec("trainer", trainer_main,
                   summary="tree-attention policy training: core cell (optimizer, updates, weight publication) "
                           "or satellite (claims micro-steps, sends gradients)")
