"""The `kvxfer` command line: plan, bench, demo, serve, drain, health.

Heavy imports (gRPC, NIXL, Mooncake, torch) happen inside the commands that need them, so that
`kvxfer plan` works with the pure core alone.

Every command reports an error the same way (:mod:`kvxfer.cli_errors`): one line
``error: <flag>: <message>`` on stderr naming the flag as the user typed it, exit code 2 when the
command cannot run with what it was given, 1 when it ran and failed.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from typer._click import exceptions as click_errors  # the parser typer vendors raises these
from typer.core import TyperCommand, TyperGroup

from kvxfer import __version__
from kvxfer.cli_errors import EXIT_FAILURE, EXIT_USAGE, describe
from kvxfer.cli_errors import report as report_error
from kvxfer.errors import KvxferError
from kvxfer.layout import CacheKind, Order


class _Commands(TyperGroup):
    """The command group, with kvxfer's one error style for usage errors (see the module docs).

    typer would print a usage error in a box drawn for the terminal's width; here it is one line
    naming the flag and the value, whatever the width, and exit code 2.
    """

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
        standalone_mode: bool = True, **extra: Any,
    ) -> Any:  # fmt: skip
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as exc:
            print(exc.format_message(), file=sys.stderr)
            code = EXIT_USAGE
        except click_errors.ClickException as exc:
            report_error(_usage_message(exc, argv))
            code = exc.exit_code
        except typer.Abort:
            report_error("aborted")
            code = EXIT_FAILURE
        else:
            code = rv if isinstance(rv, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code

    def resolve_command(self, ctx: typer.Context, args: list[str]) -> Any:  # type: ignore[override]
        """The command ``args[0]`` names; an unknown one is a usage error naming it and the known ones."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            known = ", ".join(sorted(self.commands))
            raise click_errors.UsageError(f"{name}: no such command (the commands: {known})", ctx)
        return super().resolve_command(ctx, args)


class _Command(TyperCommand):
    """A command whose stray argument is named in the error, with what the flag before it takes."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        given = list(args)  # the parser consumes ``args``
        allowed = ctx.allow_extra_args
        ctx.allow_extra_args = True
        try:
            rest = super().parse_args(ctx, args)
        finally:
            ctx.allow_extra_args = allowed
        if rest and not allowed:
            word = rest[0]
            i = given.index(word) if word in given else 0
            before = given[i - 1] if i > 0 else ""
            flags = {o for p in self.params if getattr(p, "is_flag", False) for o in getattr(p, "opts", [])}
            hint = f"; {before} takes no value" if before in flags else "; options take the form --flag value"
            raise click_errors.UsageError(f"{word}: unexpected argument{hint}", ctx)
        return rest


def _usage_message(exc: click_errors.ClickException, argv: Sequence[str]) -> str:
    """``<flag>: <what is wrong> (got <value>)`` for a usage error the parser raised."""
    if isinstance(exc, click_errors.BadParameter) and exc.param is not None:
        opts = [o for o in getattr(exc.param, "opts", []) if o.startswith("--")] or [exc.param.name or "?"]
        flag = max(opts, key=len)
        if isinstance(exc, click_errors.MissingParameter):
            return f"{flag}: missing"
        value = _given(argv, getattr(exc.param, "opts", []))
        # A choice's error names the value already ("'HDN' is not one of ..."); a number's does not.
        is_choice = bool(getattr(getattr(exc.param, "type_descriptor", None), "is_choice", False))
        got = f" (got {value!r})" if value is not None and not is_choice else ""
        # typer words a failed conversion like a validator's error ("Value error, ..."): drop that prefix.
        return f"{flag}: {exc.message.removeprefix('Value error, ').rstrip('.')}{got}"
    if isinstance(exc, click_errors.NoSuchOption):
        near = f" (did you mean {', '.join(sorted(exc.possibilities))}?)" if exc.possibilities else ""
        return f"{exc.option_name}: no such option{near}"
    if isinstance(exc, click_errors.BadOptionUsage):
        return f"{exc.option_name}: {exc.message.rstrip('.')}"
    return exc.format_message()


def _given(argv: Sequence[str], opts: Sequence[str]) -> str | None:
    """The value given for an option in ``argv`` (the last one wins, as the parser does)."""
    value = None
    for i, word in enumerate(argv):
        name, eq, rest = word.partition("=")
        if name in opts:
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


# Plain help (no rich boxes): at 80 columns rich cut long flag names (`--remote-block-s…`).
app = typer.Typer(
    help="KV-cache transfer sidecar for disaggregated prefill/decode serving.", no_args_is_help=True,
    cls=_Commands, rich_markup_mode=None,
)  # fmt: skip
bench_app = typer.Typer(help="Benchmarks (figures to quote come from here).", no_args_is_help=True, cls=_Commands,
                        rich_markup_mode=None)  # fmt: skip
app.add_typer(bench_app, name="bench")


def _usage_error(text: str) -> NoReturn:
    """Report a usage error (the command cannot run with what it was given) and exit 2."""
    report_error(text)
    raise typer.Exit(code=EXIT_USAGE)


def _failure(text: str) -> NoReturn:
    """Report a failure at run time and exit 1."""
    report_error(text)
    raise typer.Exit(code=EXIT_FAILURE)


@app.command(cls=_Command)
def version() -> None:
    """Print the kvxfer version and protocol version."""
    from kvxfer import PROTOCOL_VERSION

    print(f"kvxfer {__version__} (protocol v{PROTOCOL_VERSION})")


#: What `kvxfer plan` calls each field of the core's errors: the flag the user typed.
PLAN_FLAGS: Mapping[str, str] = {
    "num_layers": "--layers", "total_kv_heads": "--kv-heads", "num_kv_heads": "--kv-heads",
    "head_size": "--head-size", "head_size_v": "--head-size", "dtype": "--dtype", "block_size": "--block-size",
    "order": "--layout", "kind": "--kind", "cross_layer": "--cross-layer", "tp_size": "--decode-tp",
    "tp_rank": "--decode-rank", "remote_tp_size": "--prefill-tp", "blocks": "--blocks", "local_blocks": "--blocks",
    "remote_blocks": "--remote-blocks", "num_blocks": "--num-blocks", "segments": "--mamba-segments",
}  # fmt: skip
_TP_FIELDS = frozenset({"tp_size", "tp_rank", "total_kv_heads", "num_kv_heads", "segments"})
#: The same for the prefill (remote) side's layout, where the TP size and block size are its own.
PLAN_REMOTE_FLAGS: Mapping[str, str] = {
    **PLAN_FLAGS, "tp_size": "--prefill-tp", "block_size": "--remote-block-size", "num_blocks": "--remote-blocks",
}  # fmt: skip


@app.command(cls=_Command)
def plan(
    layers: Annotated[int, typer.Option(min=1, help="Layers of the model (per pipeline stage).")] = 32,
    kv_heads: Annotated[int, typer.Option(min=1, help="KV heads of the whole model (before TP).")] = 8,
    head_size: Annotated[int, typer.Option(min=1, help="Head size (MLA: latent dim; Mamba: page bytes).")] = 128,
    dtype: Annotated[str, typer.Option(help="bf16, fp16, fp32, fp8_e4m3, fp8_e5m2, nvfp4, int8.")] = "bf16",
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per block on the decode (local) side.")] = 16,
    remote_block_size: Annotated[
        int | None, typer.Option(min=1, help="Tokens per block on the prefill side (default: --block-size).")
    ] = None,
    layout: Annotated[Order, typer.Option(help="Physical order of heads and tokens.")] = Order.HND,
    kind: Annotated[CacheKind, typer.Option(help="What the cache holds.", case_sensitive=False)] = CacheKind.ATTENTION,
    cross_layer: Annotated[bool, typer.Option(help="Cross-layer (block-major) cache on both sides.")] = False,
    mamba_segments: Annotated[
        str | None,
        typer.Option(help="Mamba: the state's parts split over TP, global bytes in page order ('384,96,96,1024')."),
    ] = None,
    prefill_tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel size of the prefill (remote) side.")] = 1,
    decode_tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel size of the decode (local) side.")] = 1,
    decode_rank: Annotated[int, typer.Option(min=0, help="The decode rank to plan for.")] = 0,
    blocks: Annotated[str, typer.Option(help="Local block ids: '0:2048', '3,4,5,9' or a mix.")] = "0:2048",
    remote_blocks: Annotated[str | None, typer.Option(help="Remote block ids (default: same as --blocks).")] = None,
    num_blocks: Annotated[
        int | None, typer.Option(min=1, help="Blocks in the local cache (default: max id + 1).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show the regions and descriptors a decode rank needs to pull one request, and why."""
    from kvxfer.layout import DType
    from kvxfer.planning import ModelShape, plan_report, plan_transfer
    from kvxfer.topology import parse_block_ids

    if decode_rank >= decode_tp:
        _usage_error(f"--decode-rank: {decode_rank} is not in [0, {decode_tp}) (--decode-tp {decode_tp})")
    rbs = remote_block_size or block_size
    if max(rbs, block_size) % min(rbs, block_size):
        _usage_error(f"--remote-block-size: {rbs} and --block-size {block_size}: neither is a multiple of the other")
    segments: tuple[int, ...] = ()
    if mamba_segments is not None:
        try:
            segments = tuple(int(v) for v in mamba_segments.split(","))
        except ValueError:
            _usage_error(f"--mamba-segments: {mamba_segments!r} is not a comma-separated list of byte sizes")
        if kind is not CacheKind.MAMBA:
            _usage_error(f"--mamba-segments: only for --kind mamba, got --kind {kind.value}")
    flags, side = PLAN_FLAGS, ""
    try:
        local_ids = parse_block_ids(blocks)
        remote_ids = parse_block_ids(remote_blocks, name="remote_blocks") if remote_blocks else local_ids
        shape = ModelShape(kind, layers, kv_heads, head_size, DType.parse(dtype), layout, cross_layer, segments)
        # Each side's layout on its own first, so that an error names that side's flags.
        side = f" (decode side, --decode-tp {decode_tp})"
        shape.layout(tp_size=decode_tp, num_blocks=num_blocks or int(local_ids.max()) + 1, block_size=block_size)
        flags, side = PLAN_REMOTE_FLAGS, f" (prefill side, --prefill-tp {prefill_tp})"
        shape.layout(tp_size=prefill_tp, num_blocks=int(remote_ids.max()) + 1, block_size=rbs)
        flags, side = {**PLAN_FLAGS, "tp_size": "--prefill-tp"}, ""  # what is left is about the pair
        topo, result = plan_transfer(
            shape, prefill_tp=prefill_tp, decode_tp=decode_tp, decode_rank=decode_rank, local_blocks=local_ids,
            remote_blocks=remote_ids, block_size=block_size, remote_block_size=remote_block_size,
            num_blocks=num_blocks,
        )  # fmt: skip
    except KvxferError as exc:
        # Which side's TP size a head count failed on is worth saying; for other fields it is noise.
        _usage_error(describe(exc, flags) + (side if exc.field in _TP_FIELDS else ""))
    report = plan_report(topo, result)
    if as_json:
        print(json.dumps(report))
        return
    out = Console()
    lay = topo.local
    out.print(
        f"[bold]decode rank {decode_rank}/{decode_tp} <- prefill TP {prefill_tp}[/bold]: {lay.kind} {lay.dtype} "
        f"{lay.order}{' cross-layer' if lay.cross_layer else ''}, {lay.num_layers} layers, "
        f"{lay.num_kv_heads} of {lay.total_kv_heads} kv heads, page {lay.page_bytes} B"
    )
    regs = report["regions"]
    out.print(
        f"regions to register: {len(regs)} x {regs[0]['bytes']} B (one per {'cache' if lay.cross_layer else 'layer'})"
    )
    table = Table("remote rank", "local heads <- remote heads", "descriptors", "bytes")
    for s in report["sources"]:
        lh = f"[{s['local_head']}, {s['local_head'] + s['num_heads']})"
        rh = f"[{s['remote_head']}, {s['remote_head'] + s['num_heads']})"
        table.add_row(str(s["remote_rank"]), f"{lh} <- {rh}", str(s["descriptors"]), str(s["bytes"]))
    out.print(table)
    for s in report["sources"]:
        out.print(f"  rank {s['remote_rank']}: {s['reason']}")
    out.print(
        f"descriptors: {report['descriptors']}  bytes: {report['bytes']}  mean descriptor: "
        f"{report['mean_descriptor_bytes']:.0f} B  per-block-per-layer scheme: {report['per_block_descriptors']} "
        f"({report['coalescing_ratio']:.1f}x more)"
    )
    for w in report["warnings"]:
        out.print(f"[yellow]note:[/yellow] {w}")


@app.command(
    cls=_Command, context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
)
def serve(ctx: typer.Context) -> None:
    """Run the sidecar. Flags, KVXFER_* variables and --config are listed by `kvxfer serve --help`."""
    from kvxfer.server.cli import main as serve_cli

    raise typer.Exit(code=serve_cli(list(ctx.args)))


#: The `--target` of the commands that call a running sidecar's local API.
LocalTarget = Annotated[
    str, typer.Option(help="Local API: Unix socket path or host:port.", envvar="KVXFER_LOCAL_SOCKET")
]


@app.command(cls=_Command)
def drain(
    target: LocalTarget = "/run/kvxfer/kvxfer.sock",
    token_file: Annotated[
        str | None, typer.Option(help="File holding the shared token.", envvar="KVXFER_TOKEN_FILE")
    ] = None,
    timeout_seconds: Annotated[
        float, typer.Option(help="Drain budget, at most the sidecar's --drain-seconds (0: --drain-seconds).")
    ] = 0.0,
) -> None:
    """Ask a running sidecar to drain gracefully and wait for it (a Kubernetes preStop hook)."""
    from kvxfer.server.cli import DrainUsageError, drain_main

    if not math.isfinite(timeout_seconds) or timeout_seconds < 0:
        _usage_error(f"--timeout-seconds: must be a finite number >= 0 (0: the sidecar's --drain-seconds), "
                     f"got {timeout_seconds}")  # fmt: skip
    try:
        counts = drain_main(target, token_file=token_file, timeout_seconds=timeout_seconds)
    except DrainUsageError as exc:
        _usage_error(exc.message)
    except KvxferError as exc:
        _drain_failed(exc, target)
    print(json.dumps(counts))


#: What `kvxfer drain` calls the fields of the sidecar's Drain errors.
DRAIN_FLAGS: Mapping[str, str] = {"timeout_seconds": "--timeout-seconds", "authorization": "--token-file"}


@app.command(cls=_Command)
def health(
    target: LocalTarget = "/run/kvxfer/kvxfer.sock",
    service: Annotated[
        str, typer.Option(help="'liveness' (the process serves), or '' (ready: caches registered, not draining).")
    ] = "",
    timeout_seconds: Annotated[float, typer.Option(help="How long to wait for the answer.")] = 2.0,
) -> None:
    """Check a sidecar's health on its local API: exit 0 when SERVING (an exec probe for TLS peer ports)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvxfer.server.cli import DrainUsageError, check_target

    if not math.isfinite(timeout_seconds) or timeout_seconds <= 0:
        _usage_error(f"--timeout-seconds: must be a finite number > 0, got {timeout_seconds}")
    if service not in ("", "liveness"):
        _usage_error(f"--service: must be 'liveness' or '' (readiness), got {service!r}")
    try:
        grpc_target = check_target(target)  # as kvxfer drain reads it (a relative socket path included)
    except DrainUsageError as exc:
        _usage_error(exc.message)
    # Health needs no token: Kubernetes probes carry none, and the sidecar exempts it.
    with grpc.insecure_channel(grpc_target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_seconds
            )
        except grpc.RpcError as exc:
            _failure(f"--target: no sidecar health answer at {target}: {exc.code().name}: {exc.details()}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        raise typer.Exit(code=EXIT_FAILURE)


def _drain_failed(exc: KvxferError, target: str) -> NoReturn:
    from kvxfer.client import KvxferRpcError

    if isinstance(exc, KvxferRpcError):
        import grpc

        text = describe(KvxferError(exc.details, field=exc.field), DRAIN_FLAGS)
        if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
            _usage_error(text)
        if exc.code == grpc.StatusCode.UNAVAILABLE and exc.field is None:
            _failure(f"--target: no sidecar answers at {target}: {exc.details}")
        _failure(f"{exc.code.name}: {text}")
    _failure(exc.message)


@app.command(cls=_Command)
def demo(
    backend: Annotated[
        str, typer.Option(help="Data plane: nixl or mooncake (in the sidecars), or worker (each worker's own agent).")
    ] = "nixl",
    mode: Annotated[
        str, typer.Option(help="pull (decode READs once published) or push (decode offers first; prefill WRITEs).")
    ] = "pull",
    prefill_tp: Annotated[int, typer.Option(help="Prefill TP size (one worker + sidecar per rank).")] = 1,
    decode_tp: Annotated[int, typer.Option(help="Decode TP size (one worker + sidecar per rank).")] = 1,
    layout: Annotated[str, typer.Option(help="Physical order: HND or NHD.")] = "HND",
    kind: Annotated[str, typer.Option(help=f"What the cache holds: {', '.join(CacheKind)}.")] = "attention",
    layers: Annotated[int, typer.Option(help="Model layers.")] = 32,
    kv_heads: Annotated[int, typer.Option(help="Model KV heads (before TP).")] = 8,
    head_size: Annotated[int, typer.Option(help="Head size.")] = 128,
    dtype: Annotated[str, typer.Option(help="Cache dtype.")] = "bf16",
    block_size: Annotated[int, typer.Option(help="Tokens per block.")] = 16,
    cross_layer: Annotated[bool, typer.Option(help="Cross-layer (block-major) caches.")] = False,
    requests: Annotated[int, typer.Option(help="Requests to move.")] = 32,
    min_tokens: Annotated[int, typer.Option(help="Shortest prompt, tokens.")] = 128,
    max_tokens: Annotated[int, typer.Option(help="Longest prompt, tokens.")] = 1024,
    memory_mib: Annotated[int, typer.Option(help="Cache memory per side, MiB.")] = 1024,
    seed: Annotated[int, typer.Option(help="Random seed for block lists and contents.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Two sidecars and two synthetic workers on loopback move a Llama-3-8B-shaped cache, verified."""
    from kvxfer.harness.demo import demo_main

    code = demo_main(
        as_json=as_json, backend=backend, mode=mode, prefill_tp=prefill_tp, decode_tp=decode_tp,
        order=layout.upper(), kind=kind, layers=layers, kv_heads=kv_heads, head_size=head_size, dtype=dtype,
        block_size=block_size, cross_layer=cross_layer, requests=requests, min_tokens=min_tokens, max_tokens=max_tokens,
        memory_mib=memory_mib, seed=seed,
    )  # fmt: skip
    raise typer.Exit(code=code)


@bench_app.command("topology", cls=_Command)
def bench_topology(
    layers: Annotated[int, typer.Option(min=1, help="Layers (regions) of the cache.")] = 80,
    blocks: Annotated[int, typer.Option(min=8, help="Blocks in each cache (and of the longest request).")] = 4096,
    repeat: Annotated[int, typer.Option(min=1, help="numpy builds per case; the best counts.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Descriptor building: numpy TransferTopology vs a per-block Python loop."""
    from kvxfer.bench.topology import run

    result = run(layers=layers, blocks=blocks, repeat=repeat)
    if as_json:
        print(json.dumps(result))
        return
    table = Table("case", "numpy ms", "target", "per-block loop ms", "speedup", "descriptors", "per-block descriptors")
    for name, c in result["cases"].items():
        target = f"< {c['target_ms']:g} ms " + ("ok" if c["meets_target"] else "MISSED")
        table.add_row(
            name, f"{c['numpy_ms']:.2f}", target, f"{c['loop_ms']:.0f}", f"{c['speedup']:.0f}x",
            str(c["descriptors"]), str(c["per_block_descriptors"]),
        )  # fmt: skip
    out = Console(width=max(Console().width, 120))
    out.print(f"{layers} layers x {blocks} blocks")
    out.print(table)


@bench_app.command("transport", cls=_Command)
def bench_transport(
    backend: Annotated[str, typer.Option(help="nixl or mooncake.")] = "nixl",
    size_mib: Annotated[int, typer.Option(min=1, help="Bytes to move, in MiB.")] = 256,
    layers: Annotated[int, typer.Option(min=1, help="Layers (regions) the bytes are spread over.")] = 16,
    repeat: Annotated[
        int, typer.Option(min=1, help="Rounds in which the cases take turns; each case's best counts.")
    ] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Raw library vs kvxfer (coalesced) vs per-block descriptors vs memcpy, across two processes."""
    from kvxfer.bench.transport import run
    from kvxfer.transport import available_transports

    if backend not in available_transports():
        _usage_error(f"--backend: must be one of {', '.join(available_transports())}, got {backend!r}")

    r = run(backend=backend, size_mib=size_mib, layers=layers, repeat=repeat)
    if as_json:
        print(json.dumps(r))
    else:
        out = Console(width=max(Console().width, 120))
        table = Table("case", "descriptors", "GB/s")
        table.add_row("(a) raw, one descriptor", "1", f"{r['gbps_raw']:.2f}")
        table.add_row("(b) kvxfer, coalesced", str(r["descriptors_kvxfer"]), f"{r['gbps_kvxfer']:.2f}")
        table.add_row("(c) per block per layer", str(r["descriptors_per_block"]), f"{r['gbps_per_block']:.2f}")
        table.add_row("(d) numpy memcpy", "-", f"{r['gbps_memcpy']:.2f}")
        out.print(
            f"{backend}: {r['bytes'] >> 20} MiB, {r['layers']} layers x {r['blocks']} blocks of {r['page_bytes']} B"
        )
        out.print(table)
        out.print(
            f"b/a = {r['ratio_kvxfer_raw']:.2f}   b/c = {r['ratio_kvxfer_per_block']:.2f}   "
            f"b/d = {r['ratio_kvxfer_memcpy']:.2f}   verified: {r['verified']}"
        )
    if not r["verified"]:
        _failure("bench transport: the bytes moved differ from their source")


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KvxferError as exc:  # a failure no command reported itself
        report_error(exc.message)
        sys.exit(EXIT_FAILURE)


if __name__ == "__main__":
    main()
