"""Scripts sent together (harvest.state.roundtrip): one round trip, each runs once, on a server
that forgot its scripts too, and one's error reply neither stops nor undoes the other."""

import pytest
import redis

from harvest.state.roundtrip import ScriptCall, send_together

BUMP = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
FAIL = "return redis.error_reply('NOPE ' .. ARGV[1])"


class _Counting(redis.Connection):
    sends = 0

    def send_packed_command(self, command, check_health=True):
        type(self).sends += 1
        return super().send_packed_command(command, check_health)


@pytest.fixture
def counted(redis_server, conn):
    c = redis.Redis.from_url(redis_server.url, connection_class=_Counting)
    c.ping()
    yield c
    c.close()


def test_two_scripts_one_round_trip_each_run_once(counted):
    bump = counted.register_script(BUMP)
    calls = [ScriptCall(bump, ["a"], [2]), ScriptCall(bump, ["b"], [5])]
    send_together(counted, calls)  # loads the script (a NOSCRIPT reply on a fresh server)
    _Counting.sends = 0
    assert send_together(counted, calls) == [4, 10]
    assert _Counting.sends == 1
    assert (counted.get("a"), counted.get("b")) == (b"4", b"10")


def test_a_server_that_forgot_its_scripts_runs_each_once(counted):
    bump = counted.register_script(BUMP)
    counted.script_flush()
    assert send_together(counted, [ScriptCall(bump, ["a"], [1]), ScriptCall(bump, ["b"], [1])]) == [1, 1]
    counted.script_flush()
    assert send_together(counted, [ScriptCall(bump, ["a"], [1]), ScriptCall(bump, ["b"], [1])]) == [2, 2]


def test_an_error_reply_is_raised_after_the_other_ran(counted):
    bump, fail = counted.register_script(BUMP), counted.register_script(FAIL)
    with pytest.raises(redis.ResponseError, match="NOPE x"):
        send_together(counted, [ScriptCall(fail, [], ["x"]), ScriptCall(bump, ["a"], [3])])
    assert counted.get("a") == b"3"
