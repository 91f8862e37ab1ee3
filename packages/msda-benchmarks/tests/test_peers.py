"""The peer comparison refuses plainly where it cannot run."""

import torch
from msda_benchmarks import peers


def test_peers_says_why_it_does_not_run(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peers.main([]) == 2
    assert "CUDA GPU" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    def absent():
        import no_such_module_for_msda  # noqa: F401
    monkeypatch.setattr(peers, "PEERS", {"no_such_peer": ("no-such-distribution", absent)})
    assert peers.main([]) == 2
    assert "no peer is installed: no_such_peer" in capsys.readouterr().out
