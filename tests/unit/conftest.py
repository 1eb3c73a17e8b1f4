"""The unit tier: no engine, Ray, spawned ranks or subprocess (tests/helpers/isolation.py).

Every unit test's setup, call and teardown (module-scoped fixtures included) run inside the guard, so
a test that starts any of them fails with what it started: it belongs in tests/integration/ or
tests/e2e/. The whole tier is the inner loop: `pytest tests/unit -q`.
"""

import pytest

from tests.helpers.isolation import intercept, refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with intercept(refuse):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with intercept(refuse):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    with intercept(refuse):
        yield
