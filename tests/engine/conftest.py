import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the tiny engine's per-token forwards are dominated by thread hand-offs on a shared CI box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
