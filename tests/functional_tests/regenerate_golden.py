"""Regenerate golden values: `python -m tests.functional_tests.regenerate_golden gpt/single_rank [...]`.

`--all` regenerates every case. Runs each case's uninterrupted launch as the tests do and writes
`golden_values_cpu.json` next to its `model_config.yaml`. Review the diff before committing: a change of
golden values is a change of behaviour.
"""

import argparse
import json
import tempfile

from tests.functional_tests.fork_launcher import close_launchers
from tests.functional_tests.runner import golden_from_metrics, launch, list_cases, load_case


def regenerate(case_name, timeout_s):
    case = load_case(case_name)
    with tempfile.TemporaryDirectory(prefix="golden_") as workdir:
        metrics = launch(case, workdir, timeout_s=timeout_s, tag="full")
    golden = golden_from_metrics(case, metrics)
    case.golden_path.write_text(json.dumps(golden, indent=2) + "\n")
    return case.golden_path, golden


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names such as gpt/single_rank")
    parser.add_argument("--all", action="store_true", help="regenerate every case under test_cases/")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    options = parser.parse_args(argv)
    names = list_cases() if options.all else options.cases
    if not names:
        parser.error(f"name cases to regenerate (or --all); available: {', '.join(list_cases())}")
    try:
        for name in names:
            path, golden = regenerate(name, options.timeout)
            losses = golden["lm loss"]["values"]
            print(f"{name}: wrote {path} (lm loss {losses[min(losses, key=int)]:.6f} -> "
                  f"{losses[max(losses, key=int)]:.6f})")
    finally:
        close_launchers()


if __name__ == "__main__":
    main()
