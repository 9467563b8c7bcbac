"""One launch per trained configuration per session, shared by every test that needs it.

An uninterrupted run is keyed by what it trains (`references.training_key`): a case, a checkpoint-resume case of
the same configuration and a reference (a case, a DDP twin, a single-rank twin) with equal keys share one run.
The interrupted launches of a resume case (stop and save half way, load and continue) run once per resume case.
"""

import pytest

from tests.functional_tests import references
from tests.functional_tests.fork_launcher import close_launchers
from tests.functional_tests.runner import CaseResult, launch, load_case, resume_launches


class Runs:
    def __init__(self, tmp_path_factory):
        self._tmp_path_factory = tmp_path_factory
        self._uninterrupted = {}
        self._results = {}

    def _workdir(self, name):
        return self._tmp_path_factory.mktemp(name.replace("/", "_").replace(" ", "_").replace("(", "").replace(")", ""))

    def uninterrupted(self, case):
        """{metric: {iteration: value}} of `case` trained from scratch to --train-iters."""
        key = references.training_key(case)
        if key not in self._uninterrupted:
            self._uninterrupted[key] = launch(case, self._workdir(case.name), tag="full")
        return self._uninterrupted[key]

    def case(self, case_name):
        if case_name not in self._results:
            case = load_case(case_name)
            result = CaseResult(self.uninterrupted(case))
            if case.test_type == "ckpt-resume":
                result.first_half_metrics, result.resumed_metrics = resume_launches(case, self._workdir(case_name))
            self._results[case_name] = result
        return self._results[case_name]

    def reference(self, case_name):
        """(the reference configuration, its uninterrupted metrics) of a golden case."""
        reference = references.REFERENCES[case_name]
        case = load_case(case_name)
        if reference == references.DDP_TWIN:
            reference_case = references.ddp_twin(case)
        elif reference == references.SINGLE_RANK_TWIN:
            reference_case = references.single_rank_twin(case)
        else:
            reference_case = load_case(reference)
        return reference_case, self.uninterrupted(reference_case)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    yield Runs(tmp_path_factory)
    close_launchers()


@pytest.fixture(scope="session")
def case_result(runs):
    return runs.case
