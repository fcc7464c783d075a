"""The planner, pure: block sizes, the tier and the budgets in, a placement `Plan` out (plan.py: the plan and
the sizes it is made from; place.py: the placement; ring.py: the nvme staging ring's sizes; activations.py:
what a training forward saved, measured). It imports nothing from the scheduler, which applies the plan.
"""
