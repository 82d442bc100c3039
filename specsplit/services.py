"""Wiring of the two services from command-line settings: the one place that knows both sides."""

from __future__ import annotations

import functools
import logging
import signal
import threading
from dataclasses import dataclass

from specsplit.drafter_service.heads import TargetHead, TargetInfo
from specsplit.drafter_service.limits import DrafterLimits
from specsplit.drafter_service.server import DrafterServer, serve as serve_drafter_rpc
from specsplit.drafter_service.session import CHAIN_CAPTURE_AFTER
from specsplit.shared.checkpoint import load_config, load_state_dict
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.metrics import MetricsAddress
from specsplit.shared.profiling import StepWindow
from specsplit.shared.security import ClientSecurity, ServerSecurity
from specsplit.shared.serving import DEFAULT_MESSAGE_BYTES, Served
from specsplit.shared.tokenizer import Tokenizer
from specsplit.local import LocalSetup, build_drafter, target_dir
from specsplit.target_service.drafter_client import RemoteProposer
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.engine_process import EngineProcess
from specsplit.target_service.loop import EngineLoop
from specsplit.target_service.model import load_target
from specsplit.target_service.server import TargetServicer, serve as serve_target_rpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterSettings:
    listen: tuple[str, ...]
    setup: LocalSetup  # target (for its geometry and head), drafter, device, dtype, seed
    head: str = "auto"  # auto | checkpoint | target: where the drafter's embedding and LM head come from
    limits: DrafterLimits = DrafterLimits()  # what callers may hold (--max-targets, --max-sessions, ...)
    security: ServerSecurity = ServerSecurity()  # token and TLS its callers need (--auth-token-file, --tls-*)
    metrics: MetricsAddress | None = None  # where Prometheus scrapes it (--metrics-host/--metrics-port); None: off
    context_pool_rows: int | None = None  # DFlash context rows held for all connections (None: the default)
    profile: StepWindow | None = None  # --profile-steps/--profile-out: a torch profile of those Step messages
    chain_graphs: bool = True  # --chain-graphs (--no-chain-graphs: off): a chained step's commit and propose replayed as one CUDA graph
    chain_capture_after: int = CHAIN_CAPTURE_AFTER  # --chain-capture-after: uncaptured runs of a chained shape first
    prepare_chains: bool = True  # --prepare-chains: a chained step sent ahead prepared before the target's writes are done
    prefill_copies: bool = False  # --prefill-copies: a prefill's CUDA IPC rows copied out at once (Session.prefill)
    device_waits: bool = False  # --device-waits: ... and launched at once, our stream waiting for them (one target only)
    host_flags: bool = True  # --host-flags: a target's DONE buffer in a host page passed with its step socket hello

    def __post_init__(self) -> None:
        if self.head not in ("auto", "checkpoint", "target"):
            raise InvalidRequest("--head must be auto, checkpoint or target")
        if not self.listen:
            raise InvalidRequest("give at least one --listen address")
        if isinstance(self.chain_capture_after, bool) or not isinstance(self.chain_capture_after, int) \
                or self.chain_capture_after < 0:
            raise InvalidRequest(f"--chain-capture-after is a number of runs >= 0, got {self.chain_capture_after!r}")
        if self.device_waits and (self.limits.max_targets != 1 or not self.prepare_chains or not self.chain_graphs):
            raise InvalidRequest("--device-waits serves one target with prepared chained graphs: give it with "
                                 "--max-targets 1, and without --no-prepare-chains or --no-chain-graphs")

    @property
    def head_from_checkpoint(self) -> bool:
        """On one GPU the target shares its head through registered buffers; elsewhere we load it."""
        return self.head == "checkpoint" or (self.head == "auto" and self.setup.device == "cpu")


@dataclass(frozen=True)
class TargetSettings:
    listen: tuple[str, ...]
    setup: LocalSetup
    drafter_address: str | None  # None: serve without speculation
    engine: EngineConfig = EngineConfig()
    drafter_timeout: float = 60.0
    step_socket: bool = True  # the Step stream over the drafter's step socket when it offers one (else gRPC)
    # --device-waits: our stream waits for chained drafts on the device, not our host; None (the default): where
    # they go into the host page the drafter takes (--host-flags), else our host polls
    device_waits: bool | None = None
    host_flags: bool = True  # --host-flags: ... in a host page passed over the drafter's step socket when it takes one
    trees_ahead: bool = False  # --trees-ahead: a tree step's next candidates asked for as it launches (RemoteProposer)
    max_streams: int = 64  # Generate streams open at once; more are refused with RESOURCE_EXHAUSTED
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES  # largest Generate request accepted
    security: ServerSecurity = ServerSecurity()  # token and TLS its callers need (--auth-token-file, --tls-*)
    drafter_security: ClientSecurity = ClientSecurity()  # what it presents to its drafter (the same token)
    metrics: MetricsAddress | None = None  # where Prometheus scrapes it (--metrics-host/--metrics-port); None: off
    # --engine-process: the engine in a process of its own, its GIL apart from the gRPC front end's threads
    engine_process: bool = False

    def __post_init__(self) -> None:
        if not self.listen:
            raise InvalidRequest("give at least one --listen address")
        if self.max_streams < 1:
            raise InvalidRequest("--max-streams must be at least 1")
        if self.max_message_bytes < 1:
            raise InvalidRequest("--max-message-mib must be positive")


def checkpoint_head(folder, dtype, device) -> TargetHead:
    """The target's embedding and LM head read from its checkpoint (tied heads share one tensor)."""
    tensors = load_state_dict(folder)
    embed = tensors["model.embed_tokens.weight"].to(device=device, dtype=dtype)
    lm_head = tensors.get("lm_head.weight")
    return TargetHead(embed=embed, lm_head=embed if lm_head is None else lm_head.to(device=device, dtype=dtype))


def build_drafter_server(settings: DrafterSettings) -> DrafterServer:
    setup = settings.setup
    folder = target_dir(setup.target)
    info = TargetInfo.from_config(load_config(folder))
    head = checkpoint_head(folder, setup.torch_dtype, setup.device) if settings.head_from_checkpoint else None
    drafter = build_drafter(setup.drafter, info, head, setup, pool_rows=settings.context_pool_rows)
    if drafter is None:
        raise InvalidRequest("a drafter service needs a drafter: --drafter none is not one")
    server = DrafterServer(drafter, head=head, device=setup.device, limits=settings.limits)
    server.profile = settings.profile
    server.chain_graphs = settings.chain_graphs
    server.chain_capture_after = settings.chain_capture_after
    server.prepare_chains = settings.prepare_chains
    server.prefill_copies = settings.prefill_copies
    server.device_waits = settings.device_waits
    server.take_pages = settings.host_flags
    return server


def start_drafter(settings: DrafterSettings) -> tuple[DrafterServer, Served]:
    server_obj = build_drafter_server(settings)
    return server_obj, serve_drafter_rpc(server_obj, list(settings.listen), settings.security, settings.metrics)


def build_engine(settings: TargetSettings, tokenizer: Tokenizer | None = None) -> Engine:
    """The target's engine: its model, and a drafter client when it has a drafter (one that is down now is
    attached when it answers). `tokenizer`: the target's, where the caller has it loaded."""
    setup = settings.setup
    folder = target_dir(setup.target)
    model = load_target(folder, dtype=setup.torch_dtype, device=setup.device)
    tokenizer = tokenizer or Tokenizer.from_dir(folder)
    proposer = None
    if settings.drafter_address:
        proposer = RemoteProposer(settings.drafter_address, device=setup.device, dtype=setup.torch_dtype,
                                  timeout=settings.drafter_timeout, max_batch=settings.engine.max_batch,
                                  head=(model.embed_weight, model.lm_head_weight),
                                  security=settings.drafter_security, step_socket=settings.step_socket,
                                  device_waits=settings.device_waits, host_flags=settings.host_flags,
                                  tree_keep=settings.engine.draft_tree_keep if settings.engine.draft_tree else 0,
                                  trees_ahead=settings.trees_ahead)
    return Engine(model, proposer, settings.engine, eos_ids=tokenizer.eos_token_ids,
                  text_stream=tokenizer.output_stream)


def start_target(settings: TargetSettings) -> tuple[EngineLoop | EngineProcess, Served]:
    """The engine (in a process of its own with settings.engine_process, else a thread of this one) behind
    the gRPC front end; the caller drains the server, then stops the engine."""
    folder = target_dir(settings.setup.target)
    tokenizer = Tokenizer.from_dir(folder)
    if settings.engine_process:
        loop: EngineLoop | EngineProcess = EngineProcess(functools.partial(build_engine, settings))
    else:
        loop = EngineLoop(build_engine(settings, tokenizer))
    servicer = TargetServicer(loop, tokenizer, model_name=folder.name, max_streams=settings.max_streams)
    return loop, serve_target_rpc(servicer, list(settings.listen), max_message_bytes=settings.max_message_bytes,
                                  security=settings.security, metrics=settings.metrics)


def wait_for_signal(died: threading.Event | None = None) -> bool:
    """Block until SIGINT, SIGTERM or SIGHUP (the terminal went away): True; or until `died` is set (an engine
    in a process of its own is gone): False."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    if died is not None:
        threading.Thread(target=lambda: (died.wait(), stop.set()), name="engine-watch", daemon=True).start()
    # Woken each second: a signal the kernel hands to another thread only flags the main thread's handler, which
    # then runs at its next bytecode, and a wait without a timeout would never get there.
    while not stop.wait(1.0):
        pass
    return died is None or not died.is_set()
