"""The pure core: every decision the ledger makes, as functions of values. No I/O here.

- :mod:`~ledger.decide.classify` and :mod:`~ledger.decide.hints`: an observation becomes a
  :class:`~ledger.domain.facts.FailureFact`;
- :mod:`~ledger.decide.retry`, :mod:`~ledger.decide.health`, :mod:`~ledger.decide.profiles`:
  same-route backoff, cooldowns and disables, credential rotation;
- :mod:`~ledger.decide.preflight` and :mod:`~ledger.decide.select`: the next eligible route or a
  reasoned stop;
- :mod:`~ledger.decide.admission`, :mod:`~ledger.decide.pricing`, :mod:`~ledger.decide.begin`,
  :mod:`~ledger.decide.settle`: what an admission freezes, what a begin may use, what a settle
  records and does to holds, health and groups;
- :mod:`~ledger.decide.effects` and :mod:`~ledger.decide.turn`: the turn itself, a generator of
  typed effects that the drivers in :mod:`ledger.api.turn` perform;
- :mod:`~ledger.decide.resolve`: what settles a write whose outcome the database could not
  tell (a begin never sent, a session's exit) once it answers again;
- :mod:`~ledger.decide.inputs` and :mod:`~ledger.decide.replay`: what a decision records of its
  inputs, and what another policy would have done over recorded history.
"""
