"""The docs check: generated pages equal what their scripts produce, every PERFORMANCE table names its run, peer,
floor and command, links resolve, blocks marked `<!-- runnable -->` run, no page speaks of work rounds, and the
CHANGELOG's version is the one the package and `moefx --version` report."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "examples").glob("*.md"))]


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = _module(ROOT / "bench" / "report.py", "moefx_bench_report")
sys.path.insert(0, str(ROOT))  # the bench package
from bench.sections import coldstart, e2e  # noqa: E402
from bench.sections import stream as stream_section  # noqa: E402

# ------------------------------------------------------------------------------------------ PERFORMANCE.md


def test_performance_page_is_what_report_generates():
    assert (ROOT / "docs" / "PERFORMANCE.md").read_text() == report.render_all(), (
        "docs/PERFORMANCE.md is stale or hand-edited: run `python bench/report.py`")


def test_every_performance_table_names_its_run_peer_floor_and_command():
    text = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    assert len(sections) >= 6
    for sec in sections:
        title = sec.splitlines()[0]
        head = sec.split("\n|", 1)[0]  # everything before the first table
        assert "\n|" in sec, f"section {title!r} has no table"
        run = re.search(r"^- \*\*Run\*\*: (\d{4}-\d{2}-\d{2}), ([^,]+), torch [^,]+, triton", head, re.M)
        assert run, f"section {title!r}: no Run line with date, device and versions"
        for key in ("Peer", "Floor", "Reproduce"):
            assert re.search(rf"^- \*\*{key}\*\*: \S", head, re.M), f"section {title!r}: no {key} line"
        reproduce = re.search(r"^- \*\*Reproduce\*\*: (.*)$", head, re.M)[1]
        assert "`bash bench/run_h200.sh " in reproduce, title


def test_e2e_renders_with_null_fields_and_new_arms():
    """bench/e2e.py writes this schema; every field but the keys may be null, arms may be new."""
    row = {"layers": 8, "B": 1, "dtype": "bf16", "floor_tok_s": None, "pct_floor": None, "first_call_s": None,
           "peak_mem_gib": None, "agree_with_eager": None}
    r = {"stage": "e2e", "date": "2027-01-02", "device": "NVIDIA H200", "versions": {"torch": "2.11"}, "commit": None,
         "command": "bash bench/run_h200.sh e2e", "_file": "bench/results/e2e_h200_2027-01-02.json",
         "ceilings": {"hbm_copy_TBps": None, "bf16_matmul_TFLOPs": None},
         "decode": [{**row, "arm": "hf_static", "tok_s": 500.0}, {**row, "arm": "moefx_new_path", "tok_s": 750.0}],
         "prefill": [{"layers": 8, "tokens": 512, "arm": "hf_compiled", "ms": 9.0, "floor_ms": None, "x_floor": None}]}
    page = e2e.render_e2e(r)
    assert "| 8 | 1 | bf16 | `moefx_new_path` | 750.0 |" in page and "| 1.50 |" in page
    lines = report.headline({"e2e": r})
    assert any("`moefx_new_path`: 1.50× at 8 layers B=1" in line for line in lines)


def test_attention_renders_the_other_k_v_loads_where_a_run_has_them():
    """bench/attention.py times each slice count in both forms of the K/V loads: the op's slices in the other form get
    a column ("on" or "off" per row), the forced slice counts' other forms stay in the data only."""
    from bench.sections import attention as attention_section

    r = copy.deepcopy(report.load_results(device="h100-80gb-hbm3")["attention"])  # the run's header, kept

    def row(cache: int, choice: int, other: str | None) -> dict:
        us = {f"moefx ({choice} slices, the op's choice)": 4.0, f"moefx, {choice} slices, speculative loads on": 9.0,
              "moefx, 1 slices": 8.0, "moefx, 1 slices, speculative loads on": 7.0, "sdpa (peer)": 20.0}
        if other:
            us[f"moefx, speculative loads {other}"] = 5.0
        return {"batch": 1, "cache": cache, "written": cache // 2, "checks": {}, "us": us, "floor_us": 1.0}

    r["rows"] = [row(256, 4, "off"), row(8192, 32, "on"), row(512, 8, None)]
    page = attention_section.render_attention(r)
    head = ("| B | cache | written | the op's choice µs (slices) | the op's slices, other K/V loads µs (speculative) | "
            "1 slice µs | SDPA µs (peer) |")
    assert head in page and "| 1 | 256 | 128 | 4.00 (4) | 5.00 (off) | 8.00 | 20.00 |" in page
    assert "| 4.00 (32) | 5.00 (on) |" in page and "| 4.00 (8) | – |" in page
    assert "9.00" not in page and "7.00" not in page and "`SPECULATE_BLOCKS`" in page
    r["rows"] = [{**x, "us": {k: v for k, v in x["us"].items() if "speculative" not in k}} for x in r["rows"]]
    assert "other K/V loads" not in attention_section.render_attention(r)  # a run before them: the table as it was


def test_coldstart_and_stream_runs_are_kept_with_their_stage_commands(tmp_path, monkeypatch):
    """The 8- and 48-layer cold-start files of two calls are one kept result (a table row per arm and depth, the
    first call over transformers'); of a stream, the whole run is kept, not the prime that filled its caches."""
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "versions.txt").write_text("torch 2.11.0+cu130 triton 3.6.0 transformers 5.17.0 NVIDIA H200\n")
    for layers, cold in ((8, 30.0), (48, 90.0)):
        rows = [{"arm": "hf_static", "first_call_s": 60.0, "ready_s": 70.0},
                {"arm": "moefx_cold", "first_call_s": cold, "optimize_s": 2.0, "ready_s": cold + 9,
                 "fxgraph_cache_miss": 4},
                {"arm": "moefx_warm", "first_call_s": 6.0, "ready_s": 15.0, "fxgraph_cache_miss": 0,
                 "same_tokens_as_cold": True}]
        (run / f"coldstart_{layers}l.json").write_text(json.dumps(
            {"stage": "coldstart", "command": f"python3 bench/coldstart.py --layers {layers}", "layers": layers,
             "batch": 1, "prompt": 128, "rows": rows}))
    stream = {"stage": "stream", "command": "python3 bench/stream.py", "layers": 8, "requests": 2, "ran": 2,
              "seconds": 3.0, "tok_s": 10.0, "classes": {"B9-32 greedy": {"requests": 1, "p50_s": 1, "p99_s": 1,
                                                                          "tok_s": 5.0},
                                                         "B1 greedy": {"requests": 1, "p50_s": 1, "p99_s": 1,
                                                                       "tok_s": 5.0}},
              "captures": 2, "buckets_used": 2, "compiles": {"decode": 1}, "slot_allocations": 1, "evictions": 0,
              "memory_budget": "1 MiB", "peak_warmup_gib": 1.0, "peak_end_gib": 1.0, "peak_growth": 0.0,
              "checked": {"greedy": 1}, "checks": {"no error": True, "all 2 requests ran": False}}
    (run / "stream_8l_prime.json").write_text(json.dumps({**stream, "ran": 1}))
    (run / "stream_8l_cached.json").write_text(json.dumps(stream))
    written = {p.name: json.loads(p.read_text()) for p in report.ingest(run, "abc1234", "2026-02-03")}
    cold, kept = written["coldstart_h200_2026-02-03.json"], written["stream_h200_2026-02-03.json"]
    assert cold["command"] == "bash bench/run_h200.sh coldstart and bash bench/run_h200.sh coldstart-48"
    assert kept["ran"] == 2 and kept["command"].startswith("bash bench/run_h200.sh stream-prime and ")
    page = coldstart.render_coldstart({**cold, "_file": "x"})
    assert "| 48 | 1 | `moefx_cold` | 90.0 | 88.0 | 99.0 | 1.50 |" in page  # first call, of it after optimize
    assert "| 8 | 1 | `moefx_warm` | 6.0 | – | 15.0 |" in page  # no optimize seconds recorded
    page = stream_section.render_stream({**kept, "_file": "x"})
    assert "| all 2 requests ran | **FAIL** |" in page and page.index("B1 greedy") < page.index("B9-32 greedy")


def test_kept_results_are_one_file_per_stage(tmp_path):
    results = report.load_results()
    assert {"e2e", "moe", "fusions", "sampler", "offload"} <= set(results)
    for r in results.values():
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]) and r["_file"].endswith(f"_{r['date']}.json")
    data = {"stage": "moe", "date": "2026-01-01", "device": "d", "versions": {}, "commit": None, "command": "c"}
    for day in ("2026-01-01", "2026-01-02"):
        (tmp_path / f"moe_h200_{day}.json").write_text(json.dumps({**data, "date": day}))
    with pytest.raises(ValueError, match="keep the newest only"):
        report.load_results(tmp_path)


def test_ingest_stamps_a_run_and_replaces_the_stage_file(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    (results / "fusions_h200_2026-01-01.json").write_text("{}")
    run = tmp_path / "run"
    run.mkdir()
    (run / "versions.txt").write_text("torch 2.11.0+cu130 triton 3.6.0 transformers 5.17.0 NVIDIA H200\n")
    (run / "fusions.json").write_text(json.dumps({"meta": {"copy_bw_Bps": 1.0}, "fusions": []}))
    written = report.ingest(run, "abc1234", "2026-02-03")
    assert [p.name for p in written] == ["fusions_h200_2026-02-03.json"]
    assert sorted(p.name for p in results.iterdir()) == ["fusions_h200_2026-02-03.json"]
    kept = json.loads(written[0].read_text())
    assert kept["versions"] == {"torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.17.0"}
    assert (kept["commit"], kept["device"], kept["command"]) == ("abc1234", "NVIDIA H200",
                                                                 "bash bench/run_h200.sh fusions")


# ------------------------------------------------------------------------------------------------- README


def test_readme_generated_parts_are_current(isolated_moe_tables):
    readme = _module(ROOT / "scripts" / "readme.py", "moefx_scripts_readme")
    text = (ROOT / "README.md").read_text()
    assert readme.render(text) == text, "README.md is stale: run `python scripts/readme.py`"
    # every example snippet in the README is an example's code, and each marked region is used
    used = set(re.findall(r"<!-- example: (examples/[\w.]+)#(\w+) -->", text))
    for path in (ROOT / "examples").glob("*.py"):
        for name in re.findall(r"# \[readme:(\w+)\]", path.read_text()):
            assert (f"examples/{path.name}", name) in used, f"{path.name}#{name} is not in the README"
    table = text.split("<!-- generated: supported -->")[1].split("<!-- /generated -->")[0]
    assert "`qwen3-30b-a3b` | qwen3_moe" in table and "gemv 1–" in table  # the H200 calibration rows show up


def _slug(heading: str) -> str:
    text = re.sub(r"[`*_]", lambda m: "_" if m[0] == "_" else "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"^#{1,6} (.*)$", line)
        if m:
            slug = _slug(m[1])
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_links_resolve():
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no links inside code blocks
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # external: not fetched (CI has no network guarantee)
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def _runnable_blocks() -> list[tuple[str, str, str]]:
    blocks = []
    for page in PAGES:
        for lang, body in re.findall(r"<!-- runnable -->\n```(\w+)\n(.*?)```", page.read_text(), flags=re.S):
            blocks.append((page.relative_to(ROOT).as_posix(), lang, body))
    return blocks


def test_runnable_blocks_run(capsys, isolated_moe_tables):
    """`moefx ...` lines run in this process (the CLI's `main`), other bash lines in a shell, python blocks exec."""
    from moefx.cli import main

    blocks = _runnable_blocks()
    assert any(page == "README.md" for page, _, _ in blocks)
    for page, lang, body in blocks:
        if lang == "python":
            exec(compile(body, page, "exec"), {"__name__": "__docs__"})
            continue
        assert lang == "bash", f"{page}: runnable blocks are bash or python, not {lang}"
        for line in body.splitlines():
            argv = shlex.split(line, comments=True)
            if not argv:
                continue
            if argv[0] == "moefx":
                try:
                    rc = main(argv[1:])
                except SystemExit as exc:  # argparse actions such as --version exit
                    rc = exc.code
                assert rc in (0, None), f"{page}: `{line}` exited {rc}"
            else:
                proc = subprocess.run(line, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
                assert proc.returncode == 0, f"{page}: `{line}`\n{proc.stdout}\n{proc.stderr}"
    assert "profile = qwen3_moe" in capsys.readouterr().out  # the README's plan command planned something


# ----------------------------------------------------------------------------------------- words and version

ROUNDS = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|previous|next|last|this) "
    r"(?:session|round)s?\b|\b(?:session|round)s? ?\d+\b|\bcalls? \d+(?:[–-]\d+)?\)|\(calls? \d+\b|NOTES-moe",
    re.I)


def test_no_page_or_comment_speaks_of_work_rounds():
    files = [*PAGES, *(ROOT / "bench").glob("*.py"), *(ROOT / "bench").glob("*.sh"), *(ROOT / "scripts").glob("*"),
             *(ROOT / "moefx").rglob("*.py"), *(ROOT / "moefx").rglob("*.cpp"), *(ROOT / "moefx").rglob("*.yaml"),
             *(ROOT / "examples").glob("*"), *(ROOT / "tests").glob("*.py")]
    hits = []
    for path in files:
        if path.name == "test_docs.py" or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if ROUNDS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, "cite the measurement (date, commit), not the work round:\n" + "\n".join(hits)


def test_changelog_version_is_the_package_version(capsys):
    import moefx
    from moefx.cli import main

    version = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)[1]
    assert moefx.__version__ == version
    assert re.search(rf'^version = "{re.escape(version)}"$', (ROOT / "pyproject.toml").read_text(), re.M)
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code in (0, None)
    assert capsys.readouterr().out.split() == ["moefx", version]


def test_every_readme_python_block_runs_or_names_the_example_that_does():
    """A python block in the README either runs as written (`<!-- runnable -->`: test_runnable_blocks_run execs it)
    or its first line is `# excerpt of examples/NAME.py`, an example that tests/test_examples.py runs."""
    examples = _module(ROOT / "tests" / "test_examples.py", "moefx_tests_examples").EXAMPLES
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"(<!-- runnable -->\n)?```python\n(.*?)```", text, flags=re.S)
    assert blocks and any(runnable for runnable, _ in blocks)
    for runnable, body in blocks:
        if runnable:
            continue
        first = body.splitlines()[0]
        m = re.fullmatch(r"# excerpt of examples/([\w.]+\.py)", first)
        assert m, f"README python block is neither runnable nor an excerpt line: {first!r}"
        assert m[1] in examples and (ROOT / "examples" / m[1]).is_file(), f"{m[1]} is not an example CI runs"
        code = [line.strip() for line in body.splitlines()[1:] if line.strip()]
        source = (ROOT / "examples" / m[1]).read_text()
        assert code and all(line in source for line in code), f"the excerpt of {m[1]} is not that file's code"


def test_every_command_is_in_the_readme_table_the_cli_page_and_the_help() -> None:
    """The README's command table, docs/CLI.md's sections and `moefx --help` name the same subcommands."""
    from moefx.cli import COMMANDS, build_parser

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Command line"):]
    table = table[: table.index("\n\n", table.index("| command |"))]
    listed = set(re.findall(r"^\| `moefx ([a-z-]+)", table, re.MULTILINE))
    sections = set(re.findall(r"^## `moefx ([a-z-]+)`", (ROOT / "docs" / "CLI.md").read_text(), re.MULTILINE))
    helped = set(re.findall(r"^    ([a-z-]+)(?: |$)", build_parser([]).format_help(), re.MULTILINE))
    assert listed == set(COMMANDS), f"README table: {sorted(listed)} vs {sorted(COMMANDS)}"
    assert sections == set(COMMANDS), f"docs/CLI.md sections: {sorted(sections)} vs {sorted(COMMANDS)}"
    assert helped == set(COMMANDS), f"moefx --help: {sorted(helped)} vs {sorted(COMMANDS)}"
