"""Operations over a run's Redis state: status, metrics, the janitor, requeue, reconcile."""
