"""Hostile inputs to `lvx plan`: bad cluster and model configs (out-of-range numbers, huge
clusters, FIFOs, deep nesting) and bad flags. Each ends in exit code 1 and an error naming the
file or flag, without hanging on a FIFO or planning (allocating) for a runaway size; an existing
--json output is left as it was when planning fails."""
from pathlib import Path

from harness import Case  # noqa: F401  (the harness's case type)

SOURCE = Path(__file__).resolve().parent.parent.parent
MODEL = str(SOURCE / "configs/models/mplug_owl3_7b.yaml")
CLUSTER = str(SOURCE / "configs/clusters/a100_80g_16.yaml")
CLUSTER_TEXT = (SOURCE / "configs/clusters/a100_80g_16.yaml").read_text()


def cluster_with(old, new):
    """The A100 cluster config with one line changed, written into the case's folder."""
    assert old in CLUSTER_TEXT, old
    text = CLUSTER_TEXT.replace(old, new)
    return lambda ctx: ctx.write("cluster.yaml", text)


def plan(cluster=None, model=None, *flags):
    def argv(ctx):
        c = cluster(ctx) if callable(cluster) else (cluster or CLUSTER)
        m = model(ctx) if callable(model) else (model or MODEL)
        return ["plan", "--model", m, "--cluster", c, *flags]
    return argv


def json_kept(ctx, result):
    """The --json file written before the failing plan is unchanged."""
    got = Path(ctx.path("plan.json")).read_text()
    assert got == "{\"kept\": true}\n", f"--json output changed: {got[:80]!r}"


def plan_json_existing(*flags):
    def argv(ctx):
        ctx.write("plan.json", "{\"kept\": true}\n")
        return ["plan", "--model", MODEL, "--cluster", CLUSTER, *flags, "--json",
                ctx.path("plan.json")]
    return argv


def plan_json_fifo(*flags):
    return lambda ctx: ["plan", "--model", MODEL, "--cluster", CLUSTER, *flags, "--json",
                        ctx.fifo("plan.json")]


CASES = [
    Case("cluster_nan_bandwidth",
         plan(cluster_with("inter_node: {bandwidth_gb_per_s: 25,",
                           "inter_node: {bandwidth_gb_per_s: .nan,"), None,
              "--frames", "8", "--text", "64"),
         r"cluster\.yaml: inter_node\.bandwidth_gb_per_s: expected a finite number > 0, got nan"),
    Case("cluster_negative_bandwidth",
         plan(cluster_with("intra_node: {bandwidth_gb_per_s: 200,",
                           "intra_node: {bandwidth_gb_per_s: -200,"), None,
              "--frames", "8", "--text", "64"),
         r"intra_node\.bandwidth_gb_per_s: expected a finite number > 0, got -200"),
    Case("cluster_zero_gpus",
         plan(cluster_with("gpus_per_node: 4", "gpus_per_node: 0"), None,
              "--frames", "8", "--text", "64"),
         r"cluster\.yaml: gpus_per_node: expected > 0, got 0"),
    # Planning 10^8 ranks walked every rank's schedule: a hang, now refused while loading.
    Case("cluster_huge_gpus_per_node",
         plan(cluster_with("gpus_per_node: 4", "gpus_per_node: 100000000"), None,
              "--frames", "8", "--text", "64"),
         r"gpus_per_node: expected at most 4096, got 100000000", timeout=30),
    # nodes x gpus_per_node overflowed int64 ("ranks: expected 1..0").
    Case("cluster_nodes_overflow",
         plan(cluster_with("nodes: 4", "nodes: 4611686018427387904"), None,
              "--frames", "8", "--text", "64"),
         r"nodes: 4611686018427387904 nodes x 4 GPUs is more than the 4096 GPUs"),
    # 1e300 GiB overflowed int64 bytes into a negative device memory.
    Case("cluster_huge_memory",
         plan(cluster_with("device_memory_gib: 80", "device_memory_gib: 1e300"), None,
              "--frames", "8", "--text", "64"),
         r"device_memory_gib: expected at most"),
    Case("cluster_fifo",
         plan(lambda ctx: ctx.fifo("cluster.yaml"), None, "--frames", "8", "--text", "64"),
         r"config file '.*cluster\.yaml' is a FIFO, not a regular file", timeout=20),
    Case("model_fifo",
         plan(None, lambda ctx: ctx.fifo("model.yaml"), "--frames", "8", "--text", "64"),
         r"'.*model\.yaml' is a FIFO", timeout=20),
    Case("cluster_deep_flow_nesting",
         plan(lambda ctx: ctx.write("cluster.yaml", "name: " + "[" * 200000 + "\n"), None,
              "--frames", "8", "--text", "64"),
         r"cluster\.yaml:1: collections nest deeper than 64 levels"),
    Case("cluster_directory",
         plan(lambda ctx: str(ctx.dir), None, "--frames", "8", "--text", "64"),
         r"is a directory, not a regular file"),
    Case("json_fifo",
         plan_json_fifo("--frames", "8", "--text", "64", "--nproc", "2"),
         r"--json '.*plan\.json' is a FIFO, not a regular file", timeout=20),
    # 10^11 text tokens: a 800 GB prompt tensor was allocated before anything failed.
    Case("text_huge",
         plan(None, None, "--frames", "8", "--text", "100000000000"),
         r"--text: expected at most 16777216 tokens, got 100000000000", max_rss_mb=1024),
    Case("visual_tokens_huge",
         plan(None, None, "--frames", "1000000", "--text", "1000000"),
         r"--frames: 1000000 frames x 729 tokens per frame is more than the 134217728 visual",
         max_rss_mb=1024),
    Case("nproc_negative",
         plan(None, None, "--frames", "8", "--text", "64", "--nproc", "-1"),
         r"--nproc: expected >= 0"),
    Case("nproc_too_many",
         plan(None, None, "--frames", "8", "--text", "64", "--nproc", "17"),
         r"--nproc: cluster 'a100_80g_16' has 16 GPUs, got 17"),
    Case("tokens_per_frame_negative",
         plan(None, None, "--frames", "8", "--text", "64", "--tokens-per-frame", "-5"),
         r"--tokens-per-frame: expected >= 0"),
    Case("reserve_nan",
         plan(None, None, "--frames", "8", "--text", "64", "--reserve-gib", "nan"),
         r"--reserve-gib:? expects? a finite number"),
    Case("bad_plan_keeps_existing_json",
         plan_json_existing("--frames", "8", "--text", "4"),
         r"--text: expected >= --frames", check=json_kept),
]

