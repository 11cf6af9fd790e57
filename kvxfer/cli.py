"""The `kvxfer` command line: plan, bench, demo, serve, drain.

Heavy imports (gRPC, NIXL, Mooncake, torch) happen inside the commands that need them, so that
`kvxfer plan` works with the pure core alone.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvxfer import __version__
from kvxfer.errors import KvxferError
from kvxfer.layout import CacheKind, Order

app = typer.Typer(help="KV-cache transfer sidecar for disaggregated prefill/decode serving.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (figures to quote come from here).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console(stderr=True)


def _fail(exc: KvxferError) -> typer.Exit:
    console.print(f"[red]error:[/red] {exc}")
    return typer.Exit(code=2)


@app.command()
def version() -> None:
    """Print the kvxfer version and protocol version."""
    from kvxfer import PROTOCOL_VERSION

    print(f"kvxfer {__version__} (protocol v{PROTOCOL_VERSION})")


@app.command()
def plan(
    layers: Annotated[int, typer.Option(help="Layers of the model (per pipeline stage).")] = 32,
    kv_heads: Annotated[int, typer.Option(help="KV heads of the whole model (before TP).")] = 8,
    head_size: Annotated[int, typer.Option(help="Head size (MLA: latent dim; Mamba: page bytes).")] = 128,
    dtype: Annotated[str, typer.Option(help="bf16, fp16, fp32, fp8_e4m3, fp8_e5m2, nvfp4, int8.")] = "bf16",
    block_size: Annotated[int, typer.Option(help="Tokens per block on the decode (local) side.")] = 16,
    remote_block_size: Annotated[int | None, typer.Option(help="Tokens per block on the prefill side.")] = None,
    layout: Annotated[Order, typer.Option(help="Physical order of heads and tokens.")] = Order.HND,
    kind: Annotated[CacheKind, typer.Option(help="What the cache holds.", case_sensitive=False)] = CacheKind.ATTENTION,
    cross_layer: Annotated[bool, typer.Option(help="Cross-layer (block-major) cache on both sides.")] = False,
    prefill_tp: Annotated[int, typer.Option(help="Tensor-parallel size of the prefill (remote) side.")] = 1,
    decode_tp: Annotated[int, typer.Option(help="Tensor-parallel size of the decode (local) side.")] = 1,
    decode_rank: Annotated[int, typer.Option(help="The decode rank to plan for.")] = 0,
    blocks: Annotated[str, typer.Option(help="Local block ids: '0:2048', '3,4,5,9' or a mix.")] = "0:2048",
    remote_blocks: Annotated[str | None, typer.Option(help="Remote block ids (default: same as --blocks).")] = None,
    num_blocks: Annotated[int | None, typer.Option(help="Blocks in the local cache (default: max id + 1).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show the regions and descriptors a decode rank needs to pull one request, and why."""
    from kvxfer.layout import DType
    from kvxfer.planning import ModelShape, plan_report, plan_transfer
    from kvxfer.topology import parse_block_ids

    try:
        local_ids = parse_block_ids(blocks)
        remote_ids = parse_block_ids(remote_blocks) if remote_blocks else local_ids
        shape = ModelShape(kind, layers, kv_heads, head_size, DType.parse(dtype), layout, cross_layer)
        topo, result = plan_transfer(
            shape, prefill_tp=prefill_tp, decode_tp=decode_tp, decode_rank=decode_rank, local_blocks=local_ids,
            remote_blocks=remote_ids, block_size=block_size, remote_block_size=remote_block_size,
            num_blocks=num_blocks,
        )  # fmt: skip
    except KvxferError as exc:
        raise _fail(exc) from None
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(code=2) from None
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


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def serve(ctx: typer.Context) -> None:
    """Run the sidecar. Flags, KVXFER_* variables and --config are listed by `kvxfer serve --help`."""
    from kvxfer.server.cli import main as serve_cli

    raise typer.Exit(code=serve_cli(list(ctx.args)))


@app.command()
def drain(
    target: Annotated[
        str, typer.Option(help="Local API: Unix socket path or host:port.", envvar="KVXFER_LOCAL_SOCKET")
    ] = "/run/kvxfer/kvxfer.sock",
    token_file: Annotated[
        str | None, typer.Option(help="File holding the shared token.", envvar="KVXFER_TOKEN_FILE")
    ] = None,
    timeout_seconds: Annotated[float, typer.Option(help="Drain budget (0: the sidecar's --drain-seconds).")] = 0.0,
) -> None:
    """Ask a running sidecar to drain gracefully and wait for it (a Kubernetes preStop hook)."""
    from kvxfer.server.cli import drain_main

    print(json.dumps(drain_main(target, token_file=token_file, timeout_seconds=timeout_seconds)))


@app.command()
def demo(
    backend: Annotated[str, typer.Option(help="Data plane: nixl or mooncake.")] = "nixl",
    prefill_tp: Annotated[int, typer.Option(help="Prefill TP size (one worker + sidecar per rank).")] = 1,
    decode_tp: Annotated[int, typer.Option(help="Decode TP size (one worker + sidecar per rank).")] = 1,
    layout: Annotated[str, typer.Option(help="Physical order: HND or NHD.")] = "HND",
    kind: Annotated[str, typer.Option(help="attention, quantized, mla or mamba.")] = "attention",
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
        as_json=as_json, backend=backend, prefill_tp=prefill_tp, decode_tp=decode_tp, order=layout.upper(), kind=kind,
        layers=layers, kv_heads=kv_heads, head_size=head_size, dtype=dtype, block_size=block_size,
        cross_layer=cross_layer, requests=requests, min_tokens=min_tokens, max_tokens=max_tokens,
        memory_mib=memory_mib, seed=seed,
    )  # fmt: skip
    raise typer.Exit(code=code)


@bench_app.command("topology")
def bench_topology(
    layers: int = 80,
    blocks: int = 4096,
    repeat: Annotated[int, typer.Option(help="numpy builds per case; the best counts.")] = 20,
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


@bench_app.command("transport")
def bench_transport(
    backend: Annotated[str, typer.Option(help="nixl or mooncake.")] = "nixl",
    size_mib: Annotated[int, typer.Option(help="Bytes to move, in MiB.")] = 256,
    layers: Annotated[int, typer.Option(help="Layers (regions) the bytes are spread over.")] = 16,
    repeat: Annotated[int, typer.Option(help="Rounds in which the cases take turns; each case's best counts.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Raw library vs kvxfer (coalesced) vs per-block descriptors vs memcpy, across two processes."""
    from kvxfer.bench.transport import run

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
        raise typer.Exit(code=1)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KvxferError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
