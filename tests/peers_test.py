"""benchmarks/peers.py: its flags, the DDP set-up of each torch row, the rows and the table.

None of these needs PyTorch or root except the last two, which use the environment peers.py makes
(``.venv-torch``): benchmarks/torch_zoo.py's models against jaxcomp.training.zoo's, and the torch
worker on two processes over loopback. They are skipped, with the reason, where that environment is
absent (CI never installs PyTorch).
"""

import json
import os
import socket
import subprocess

import pytest
from helpers import load_benchmark

from jaxcomp.distributed import netbench
from jaxcomp.training import zoo

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "peers.py"
)


peers = load_benchmark("peers")


# -- models ---------------------------------------------------------------------------------------


def test_models_are_the_zoos():
    assert tuple(peers.MODELS) == zoo.NAMES


def test_mlps_have_the_issues_shapes():
    assert peers.torch_widths("mlp4096") == (1024, 4096, 4096, 1024, 10)
    assert peers.mlp_params(peers.torch_widths("mlp4096")) == 25_185_290  # the issue's 25.2M
    assert peers.torch_widths("mlp2041") == (2041,) * 7  # six 2041x2041 layers
    for name in ("gpt2", "resnet50", "many_small"):
        assert peers.torch_widths(name) is None


@pytest.mark.parametrize("params", [1e3, 2e5, 1e6, 25e6, peers.MLP2041_PARAMS])
def test_square_mlp_matches_netbenchs_width(params):
    # The torch MLP and netbench's flax MLP must be the same model for the rows to be comparable.
    width = netbench.width_for(params, netbench.DEFAULT_LAYERS)
    assert peers.torch_widths("mlp2041", params) == (width,) * (netbench.DEFAULT_LAYERS + 1)


def test_netbench_trains_the_zoo_model_or_its_own_resized_mlp():
    assert peers.netbench_options("mlp4096", None) == {"models": ("mlp4096",)}
    assert peers.netbench_options("mlp2041", None) == {"models": ("mlp2041",)}
    assert peers.netbench_options("mlp2041", 2e5) == {"params": 2e5, "layers": 6}


# -- DDP set-up -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n_params", [1000, 25_185_290, 124_000_000, 400_000_000])
def test_powersgd_puts_every_gradient_in_one_bucket(n_params):
    options = peers.ddp_options("powersgd", n_params, rank=4, start_iter=2)
    assert options["hook"] == "powerSGD_hook.powerSGD_hook"
    assert options["bucket_cap_mb"] >= 1024
    assert options["bucket_cap_mb"] * 2**20 > 4 * n_params
    assert options["powersgd"]["matrix_approximation_rank"] == 4
    assert options["powersgd"]["start_powerSGD_iter"] == 2
    assert options["label"] == "ddp+powerSGD_hook(rank=4)"


def test_other_rows_keep_ddps_default_buckets_and_name_their_hook():
    hooks = {m: peers.ddp_options(m, 25_185_290) for m in ("plain", "fp16", "bf16")}
    assert hooks["plain"]["hook"] is None
    assert hooks["fp16"]["hook"] == "default_hooks.fp16_compress_hook"
    assert hooks["bf16"]["hook"] == "default_hooks.bf16_compress_hook"
    assert all(h["bucket_cap_mb"] is None and h["powersgd"] is None for h in hooks.values())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "nope"}, "torch method"),
        ({"method": "powersgd", "rank": 0}, "rank"),
        ({"method": "powersgd", "start_iter": 1}, "start_powerSGD_iter"),
    ],
)
def test_bad_ddp_options_are_refused(kwargs, match):
    method = kwargs.pop("method")
    with pytest.raises(ValueError, match=match):
        peers.ddp_options(method, 1000, **kwargs)


def test_powersgd_warms_up_past_its_plain_steps():
    assert peers.torch_warmup("powersgd", 0, 2) == 3
    assert peers.torch_warmup("powersgd", 5, 2) == 5
    assert peers.torch_warmup("fp16", 0, 2) == 0


# -- flags ----------------------------------------------------------------------------------------


def _config(*argv):
    return peers.config_from_args(peers.build_parser().parse_args(list(argv)))


def test_defaults_are_the_issues_setup():
    config = _config()
    assert config.models == ("mlp4096",) and config.hosts == (4,) and config.batch == 2
    assert config.rates == ("1gbit", "100mbit") and config.powersgd_rank == 4
    assert config.torch_methods == ("plain", "fp16", "bf16", "powersgd")
    assert config.jax_methods[0] == "pmean" and config.torch_optimizer == "sgd"


def test_baselines_always_run_first():
    config = _config("--torch-methods", "powersgd", "--jax-methods", "ar_topk")
    assert config.torch_methods == ("plain", "powersgd")
    assert config.jax_methods == ("pmean", "ar_topk")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--models", "mlp9"], "--models"),
        (["--hosts", "0"], "--hosts"),
        (["--hosts", "x"], "--hosts"),
        (["--frameworks", "jax"], "--frameworks"),
        (["--torch-methods", "fp8"], "--torch-methods"),
        (["--params", "10", "--models", "mlp2041"], "--params"),
        (["--params", "1e5"], "sizes mlp2041 only"),
        (["--steps", "0"], "--steps"),
        (["--warmup", "-1"], "--warmup"),
        (["--powersgd-start", "1"], "--powersgd-start"),
        (["--powersgd-rank", "0"], "--powersgd-rank"),
        (["--rates", ","], "--rates"),
        (["--lr", "0"], "--lr"),
        (["--json", "/nonexistent/peers.json"], "folder"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        _config(*argv)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--rates", "fast"], "--rates"),
        (["--jax-methods", "nope"], "--jax-methods"),
        (["--models", "x"], "--models"),
    ],
)
def test_main_exits_2_with_the_reason_before_building_anything(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        peers.main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


# -- rows and table -------------------------------------------------------------------------------


def _host_result(rank, steps):
    methods = {}
    for method, step in steps.items():
        label = peers.ddp_options(method, 1000)["label"]
        methods[method] = {
            "label": label,
            "step": step + rank,
            "cpu": 0.1 * (rank + 1),
            "wire_tx": 1e6 * (rank + 1),
            "times": [step],
            "loss": 1.0,
            "warmup": 2,
            "bucket_cap_mb": None,
        }
    return {
        "rank": rank,
        "torch": "2.13.0+cpu",
        "params": 25_185_290,
        "compute": 0.2 + rank,
        "methods": methods,
    }


def test_torch_rows_take_the_slowest_host_and_average_cpu_and_wire():
    results = [_host_result(r, {"plain": 2.0, "fp16": 1.0}) for r in range(2)]
    plain, fp16 = peers.torch_rows(results, "mlp4096", 2, "1gbit")
    assert plain["params"] == 25_185_290
    assert plain["method"] == "ddp" and fp16["method"] == "ddp+fp16_compress_hook"
    assert plain["step"] == 3.0 and fp16["step"] == 2.0  # host 1 is a second slower
    assert fp16["cpu"] == pytest.approx(0.15) and fp16["wire_tx"] == pytest.approx(1.5e6)
    assert fp16["speedup"] == pytest.approx(1.5) and fp16["compute"] == pytest.approx(1.2)


def _rows():
    rows = [
        {
            "model": "mlp4096",
            "params": 25_185_290,
            "hosts": 4,
            "rate": "1gbit",
            "framework": "jaxcomp",
            "method": "pmean",
            "step": 2.0,
            "compute": 0.3,
            "cpu": None,
            "wire_tx": 150e6,
            "speedup": 1.0,
        }
    ]
    results = [_host_result(r, {"plain": 4.0, "powersgd": 1.0}) for r in range(1)]
    return rows + peers.torch_rows(results, "mlp4096", 4, "1gbit")


def test_table_has_one_line_per_row_and_both_speedups():
    rows = peers.add_cross_speedups(_rows())
    lines = peers.table(rows).splitlines()
    assert len(lines) == 2 + 3
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    jax_line = next(line for line in lines if "| jaxcomp | pmean |" in line)
    assert "| 2.000 |" in jax_line and "| - |" in jax_line and "| 150.0 |" in jax_line
    assert jax_line.endswith("| 1.00x | 2.00x |")  # torch's plain DDP took 4 s
    psgd = next(line for line in lines if "powerSGD_hook(rank=4)" in line)
    assert psgd.endswith("| 4.00x | 4.00x |")


def test_small_byte_counts_keep_their_digits():
    assert peers._mb(44_226) == "0.044" and peers._mb(100.9e6) == "100.9" and peers._mb(None) == "-"


def test_header_names_the_command_machine_and_optimizers():
    info = {**peers.machine(), "torch": "2.13.0+cpu", "jax": "0.10.2"}
    assert info["nproc"] >= 1 and info["cpu"]
    text = peers.header(_config(), info, ["benchmarks/peers.py", "--rates", "1gbit"])
    assert "command: benchmarks/peers.py --rates 1gbit" in text
    assert f"{info['nproc']} cores" in text and "torch 2.13.0+cpu" in text
    assert "Adam(1e-4)" in text and "SGD(lr=0.001)" in text
    text = peers.header(_config("--jax-optimizer", "sgd"), info, ["benchmarks/peers.py"])
    assert "jaxcomp rows SGD(1e-4)" in text


def test_the_jax_optimizer_reaches_netbench(monkeypatch):
    """--jax-optimizer is netbench's --optimizer: every jaxcomp row of the cell runs with it."""
    seen = {}

    def fake_run(**kwargs):
        seen.update(kwargs)
        return []

    monkeypatch.setattr(netbench, "run_benchmark", fake_run)
    peers.jaxcomp_cell(_config("--jax-optimizer", "sgd"), "mlp4096", 4, "1gbit", "log")
    assert seen["optimizer"] == "sgd"
    assert _config().jax_optimizer == "adam"


def test_missing_torch_environment_is_an_error_when_install_is_off(tmp_path):
    config = peers.Config(torch_venv=str(tmp_path / "none"), install=False)
    with pytest.raises(RuntimeError, match="--no-install"):
        peers.ensure_torch(config)


# -- the torch worker (needs the torch environment) ----------------------------------------------


def _torch_or_skip():
    version, why = peers._check_torch(peers.DEFAULT_TORCH_VENV)
    if version is None:
        pytest.skip(
            f"no PyTorch environment for peers.py ({why}); `python benchmarks/peers.py` makes one"
        )
    return peers.torch_python(peers.DEFAULT_TORCH_VENV)


def test_torch_zoo_has_the_zoos_parameter_and_tensor_counts():
    python = _torch_or_skip()
    # Shapes only (meta tensors: no memory, no initializers), counted in the torch environment.
    script = (
        "import json, sys, torch, torch_zoo\n"
        "counts = {}\n"
        "for name, widths in json.loads(sys.argv[1]).items():\n"
        "    with torch.device('meta'):\n"
        "        model = torch_zoo.build(name, mlp_widths=widths)[0]\n"
        "    counts[name] = [sum(p.numel() for p in model.parameters()), "
        "len(list(model.parameters()))]\n"
        "print(json.dumps(counts))"
    )
    widths = {name: peers.torch_widths(name) for name in zoo.NAMES}
    result = subprocess.run(
        [python, "-c", script, json.dumps(widths)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(SCRIPT),
    )
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout)
    for name in zoo.NAMES:
        model = zoo.build(name, abstract=True)
        assert counts[name] == [model.n_params, model.n_leaves], name


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_worker_runs_every_hook_over_gloo_on_loopback(tmp_path):
    python = _torch_or_skip()
    spec = {
        "model": "mlp2041",
        "widths": [64] * 7,
        "methods": list(peers.TORCH_METHODS),
        "batch": 2,
        "steps": 2,
        "warmup": 0,
        "powersgd_rank": 4,
        "powersgd_start": 2,
        "optimizer": "sgd",
        "lr": 1e-3,
        "timeout": 60,
        "out": str(tmp_path),
    }
    base = dict(
        os.environ,
        JAXCOMP_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}",
        JAXCOMP_NUM_PROCESSES="2",
        JAXCOMP_INTERFACE="lo",
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [python, SCRIPT, "--torch-worker", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(base, JAXCOMP_PROCESS_ID=str(rank)),
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    results = [json.loads((tmp_path / f"torch-{rank}.json").read_text()) for rank in range(2)]
    assert results[0]["threads"] == 1
    psgd = results[0]["methods"]["powersgd"]
    assert psgd["buckets_per_step"] == 1 and psgd["bucket_cap_mb"] >= 1024
    assert psgd["powersgd_iter"] > 2  # the timed steps were compressed ones
    rows = peers.torch_rows(results, "mlp2041", 2, "none")
    assert rows[0]["params"] == peers.mlp_params(spec["widths"])
    assert [r["method"] for r in rows] == [
        "ddp",
        "ddp+fp16_compress_hook",
        "ddp+bf16_compress_hook",
        "ddp+powerSGD_hook(rank=4)",
    ]
    assert all(r["step"] > 0 and r["cpu"] > 0 for r in rows)
