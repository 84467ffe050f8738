"""The README's complete examples run as written (issue 13, item 8)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def example(heading: str) -> str:
    """The first ``python`` code block after the line ``heading``."""
    start = README.index(f"\n{heading}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(README, start)
    assert match is not None, heading
    return match.group(1)


def run(tmp_path: Path, name: str, source: str, *argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text(source)
    return subprocess.run([sys.executable, *argv, str(path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(120)
def test_a_first_dataflow_runs_as_a_script_and_under_the_launcher(tmp_path):
    source = example("## A first dataflow")
    direct = run(tmp_path, "first.py", source)
    assert direct.returncode == 0, direct.stderr
    assert "['any picklable value', 'any picklable value']" in direct.stdout
    assert direct.stdout.count("('a', 2)") == 3 and direct.stdout.count("('b', 1)") == 3  # 3 epochs
    launched = run(tmp_path, "first.py", source, "-m", "timely.launch", "-w", "2")
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout.count("('a', 2)") == 3 and "picklable" not in launched.stdout


@pytest.mark.timeout(120)
def test_the_testing_example_runs(tmp_path):
    done = run(tmp_path, "testing_example.py", example("### Testing your dataflows"))
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(150)
def test_the_megaphone_example_finishes_its_migration(tmp_path):
    done = run(tmp_path, "migrate_demo.py", example("## Megaphone: live state migration"),
               "-m", "timely.launch", "-w", "2", "--timeout", "120")
    assert done.returncode == 0, done.stderr
    assert "worker 0 owns 192 of 256 bins" in done.stdout and "worker 1 owns 64 of 256 bins" in done.stdout


@pytest.mark.timeout(120)
def test_the_columnar_example_runs_as_a_script_and_under_the_launcher(tmp_path):
    source = example("## Columnar dataflows")
    for argv in ([], ["-m", "timely.launch", "-w", "2"]):
        done = run(tmp_path, "columnar_job.py", source, *argv)
        assert done.returncode == 0, done.stderr
        # (two workers' prints may interleave within a line: count the rows, not the lines)
        rows = re.findall(r"\((\d), \d+, \d+, \d+\)", done.stdout)
        assert sorted(rows) == sorted("0123" * 3), done.stdout  # 4 auctions in each of 3 epochs


@pytest.mark.timeout(120)
def test_the_columnar_megaphone_example_runs(tmp_path):
    done = run(tmp_path, "megaphone_columns.py", example("### Megaphone on columns"))
    assert done.returncode == 0, done.stderr
    assert "worker 0 holds bins" in done.stdout
    assert "{'auction': 0, 'price_sum': 80, 'price_count': 8, 'price_max': 10, 'price_mean': 10.0}" in done.stdout


@pytest.mark.timeout(120)
def test_the_operator_builder_example_splits_signs_on_two_workers(tmp_path):
    block = example("### Building an operator")
    source = (
        "import timely\n\n"
        "def main(worker):\n"
        "    with worker.dataflow() as scope:\n"
        "        source = scope.new_input()\n"
        "        s = source.stream\n"
        + "".join(f"        {line}\n" for line in block.splitlines())
        + "        got = positives.capture(), negatives.capture()\n"
        "    source.send_batch([1, -2, 3, -4, 0] if worker.index == 0 else [5, -6])\n"
        "    source.close()\n"
        "    worker.finish()\n"
        "    return [sorted(x for _, batch in c.extract() for x in batch) for c in got]\n\n"
        "results = timely.execute(main, workers=2, timeout=60)\n"
        "print(sorted(x for r in results for x in r[0]), sorted(x for r in results for x in r[1]))\n")
    done = run(tmp_path, "builder.py", source)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 1, 3, 5] [-6, -4, -2]"
