"""One launch per trained configuration per session, shared by every test that needs it.

An uninterrupted run is keyed by what it trains (`references.training_key`): a case, a checkpoint-resume case of
the same configuration and a reference (a case, a DDP twin, a single-rank twin) with equal keys share one run.
Where a resume case has the key, the run is that case's, saving at N/2 on the way (checkpoint flags do not change
what a run trains); the resume case's one more launch loads that checkpoint and trains to N.
"""

import pytest

from tests.functional_tests import references
from tests.functional_tests.fork_launcher import close_launchers
from tests.functional_tests.runner import CaseResult, list_cases, load_case, resumed_launch, uninterrupted_launch


def resume_case_by_training_key():
    """{training key: the ckpt-resume case that trains it}; two resume cases may not train the same thing (the
    shared run saves with one case's checkpoint flags)."""
    by_key = {}
    for name in list_cases():
        case = load_case(name)
        if case.test_type == "ckpt-resume":
            other = by_key.setdefault(references.training_key(case), case)
            if other is not case:
                raise ValueError(f"{name} and {other.name} train the same configuration: keep one of them")
    return by_key


class Runs:
    def __init__(self, tmp_path_factory):
        self._tmp_path_factory = tmp_path_factory
        self._resume_cases = resume_case_by_training_key()
        self._uninterrupted = {}  # training key -> (workdir, metrics)
        self._results = {}

    def _workdir(self, name):
        return self._tmp_path_factory.mktemp(name.replace("/", "_").replace(" ", "_").replace("(", "").replace(")", ""))

    def _run(self, case):
        """(workdir, metrics) of the uninterrupted run that trains `case`."""
        key = references.training_key(case)
        if key not in self._uninterrupted:
            launched = self._resume_cases.get(key, case)  # a resume case's run also saves its checkpoint
            workdir = self._workdir(launched.name)
            self._uninterrupted[key] = workdir, uninterrupted_launch(launched, workdir)
        return self._uninterrupted[key]

    def uninterrupted(self, case):
        """{metric: {iteration: value}} of `case` trained from scratch to --train-iters."""
        return self._run(case)[1]

    def case(self, case_name):
        if case_name not in self._results:
            case = load_case(case_name)
            saved_in, metrics = self._run(case)
            result = CaseResult(metrics)
            if case.test_type == "ckpt-resume":
                result.resumed_metrics = resumed_launch(case, saved_in, self._workdir(f"{case_name}_resumed"))
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
