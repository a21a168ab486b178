"""The weighted IQL critic (docs/critic.md): model, training, scoring, reranking.

Entry points (import lazily; they pull in torch):

* :func:`qevolve_cli.critic.trainer.train_critic` (``qevolve critic``)
* :func:`qevolve_cli.critic.score.score_table` (``qevolve label --critic``), :func:`~.score.process_rewards`
* :class:`qevolve_cli.critic.rerank.CriticReranker` / :func:`~.rerank.rerank` (``qevolve eval --critic``)
* :func:`qevolve_cli.tabular.tabular_iql` (exact dataset-constrained IQL on a finite MDP; tests)

:class:`qevolve_cli.critic.config.CriticConfig` is torch-free.
"""
