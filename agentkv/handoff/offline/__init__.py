"""Making a mapper, offline: what ``agentkv calibrate``, ``agentkv evaluate`` and ``agentkv bench handoff`` run.

- :mod:`.collect`: both models' position-free keys and values on the same tokens; :mod:`.corpus`: the text;
- :mod:`.ranking`: which source layers feed each target layer; :mod:`.linalg`: ridge from streamed statistics;
- :mod:`.fit`: fitting ``ridge`` and ``mlp``; :mod:`.calibration`: collect -> rank -> fit -> evaluate;
- :mod:`.evaluation`: the target's own attention and next tokens on mapped caches; :mod:`.bench`: map time against
  re-prefill; :mod:`.report`, :mod:`.cli`;
- :mod:`.calibrated`: a mapper between two checkpoint folders, calibrated once per machine;
- :mod:`.config`: the settings; :mod:`.testing`: stand-ins for tests without checkpoints.

Nothing at an escalation imports this package (``tests/test_handoff_layout.py`` checks it).
"""
