"""The built-in task families and verifiers, one module each, registered by import path in
factory/protocols/task.py (`TASK_FAMILIES`, `VERIFIERS`): `arithmetic` (generated), `word_problems` and `code`
(shipped sets, `suites`), and the field's verifiers of source rows (`field`: reasoning-gym, math-verify, HumanEval)."""
