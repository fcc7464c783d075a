"""ForwardOrder: the first step's block order drives prefetch, update priority and read-ahead."""

from offload.scheduler.records.forward_order import ForwardOrder


def test_first_use_order_positions_and_blocks_never_seen():
    order = ForwardOrder(5)
    assert order.first is None and order.after(0) is None
    assert [order.record(i) for i in (2, 0, 2, 3)] == [True, True, False, True]  # a block used twice counts once
    assert order.first == 2 and order.after(2) == 0 and order.after(3) is None and order.after(4) is None
    assert [order.priority(i) for i in (2, 0, 3)] == [0, 1, 2]
    assert order.priority(1) > order.priority(3) and order.priority(4) > order.priority(1)  # never seen: last
    assert order.update_order() == [2, 0, 3, 1, 4]
    assert order.reversed() == [3, 0, 2]
