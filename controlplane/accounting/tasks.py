from celery import shared_task


def check_budgets() -> int:
    """Write the budget warnings and exhaustions of this period that are not written yet."""
    from controlplane.accounting.budgets import budget_states, record_budget_warnings

    return record_budget_warnings(budget_states())


@shared_task(ignore_result=True)
def check_budgets_task() -> int:
    return check_budgets()
