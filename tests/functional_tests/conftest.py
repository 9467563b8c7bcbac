"""One run per functional case per session, shared by the golden-value and the cross-layout tests."""

import pytest

from tests.functional_tests.runner import load_case, run_case


@pytest.fixture(scope="session")
def case_result(tmp_path_factory):
    results = {}

    def get(case_name):
        if case_name not in results:
            case = load_case(case_name)
            workdir = tmp_path_factory.mktemp(case_name.replace("/", "_"))
            results[case_name] = run_case(case, workdir)
        return results[case_name]

    return get
