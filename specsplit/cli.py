"""The `specsplit` command line: argument parsing and dispatch only; the work lives in the packages."""

from __future__ import annotations

import argparse
import json
import sys
import uuid

from shared.errors import SpecsplitError
from shared.sampling import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="prompt text, encoded without special tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seeds sampling (and a random drafter)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-speculation", action="store_true", help="decode with the target alone")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or a folder")
    p.add_argument("--drafter", default="none",
                   help="none | dflash | mtp (randomly initialised, seeded) | a drafter checkpoint folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop_strings=tuple(args.stop), ignore_eos=args.ignore_eos,
    )


def print_result(args: argparse.Namespace, token_ids: list[int], text: str, stats: dict) -> None:
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "stats": stats}))
        return
    print(text)
    print(f"[{len(token_ids)} tokens, {stats['steps']} steps, drafted {stats['drafted']}, "
          f"accepted {stats['accepted']}, tau {stats['tau']:.2f}]", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> None:
    if args.server:
        from specsplit.remote import generate_remote

        token_ids, text, stats = generate_remote(args.server, args.prompt, sampling_from(args),
                                                 chat=args.chat, speculative=not args.no_speculation)
        print_result(args, token_ids, text, stats)
        return
    from specsplit.local import LocalSetup, load_local
    from target_service.sequence import Request

    setup = LocalSetup(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype,
                       seed=args.seed or 0)
    engine, tokenizer = load_local(setup)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    request = Request(uuid.uuid4().hex, tokenizer.encode(prompt), sampling_from(args),
                      speculative=not args.no_speculation)
    events = engine.generate([request])[request.request_id]
    token_ids = [t for e in events for t in e.token_ids]
    print_result(args, token_ids, "".join(e.text_delta for e in events), events[-1].stats.as_dict())


def cmd_init_drafter(args: argparse.Namespace) -> None:
    from drafter_service.checkpoint import write_random_drafter
    from specsplit.local import target_dir
    from shared.config import ModelConfig, read_config_json
    from drafter_service.heads import TargetInfo

    info = TargetInfo.from_config(ModelConfig.from_hf(read_config_json(target_dir(args.target))))
    write_random_drafter(args.out, args.kind, info, seed=args.seed, num_layers=args.layers,
                         block_size=args.block_size)
    print(args.out)


def cmd_convert(args: argparse.Namespace) -> None:
    from shared.gguf_import import default_target_dir

    print(default_target_dir())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsplit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text, in-process (--local) or through a target service")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run target and drafter in this process")
    where.add_argument("--server", metavar="ADDR", help="a target service: host:port or unix:PATH")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    init = sub.add_parser("init-drafter", help="write a randomly initialised drafter checkpoint for a target")
    init.add_argument("--kind", choices=["dflash", "mtp"], required=True)
    init.add_argument("--target", default="default")
    init.add_argument("--out", required=True)
    init.add_argument("--layers", type=int, default=1)
    init.add_argument("--block-size", type=int, default=16)
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=cmd_init_drafter)

    conv = sub.add_parser("convert-default", help="convert the embedded GGUF target once; print its folder")
    conv.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SpecsplitError as exc:
        print(f"specsplit: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
