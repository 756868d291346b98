"""Ids, numbers, bodies, Range headers and live topics as a request gives them: read strictly, refused in words."""
import pytest
from django.http import QueryDict

from clusters.agent_views import requested_range
from console import bodies, live, params

BEYOND_BIGINT = str(2**63)
LONG_NUMBER = "9" * 5000  # past the 4,300 digits Python's int() reads from a string


# -- ids and numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["1", "42", " 7 ", str(params.ID_MAX), 5])
def test_an_id_in_the_digits_0_to_9_within_the_bigint_range_is_read(raw):
    assert params.parse_int(raw, name="machine") == int(str(raw).strip())


@pytest.mark.parametrize("raw", [
    "١٢",  # Arabic-Indic digits, which int() reads as 12
    "²",  # a superscript, which str.isdigit() accepts and int() refuses
    BEYOND_BIGINT, LONG_NUMBER, "0", "-3", "+3", "3.0", "1e3", "0x10", "", "abc", True, 2.0, None, [3],
])
def test_anything_else_is_refused_with_a_sentence_that_quotes_it(raw):
    with pytest.raises(params.InvalidParameter) as refused:
        params.parse_int(raw, name="machine")

    assert refused.value.name == "machine"
    assert refused.value.message.startswith("Give a whole number from 1 to 9,223,372,036,854,775,807 in the digits 0-9, not ")
    assert len(refused.value.message) < 200  # a 5,000-digit number is quoted cut short


def test_a_number_in_a_query_string_is_its_default_when_absent_or_blank_and_refused_when_given_twice():
    assert params.int_param(QueryDict(""), "page", default=1) == 1
    assert params.int_param(QueryDict("page="), "page", default=1) == 1
    assert params.int_param(QueryDict("page=3"), "page", default=1) == 3
    with pytest.raises(params.InvalidParameter, match="Give one value, not 2"):
        params.int_param(QueryDict("page=3&page=4"), "page")
    with pytest.raises(params.InvalidParameter):
        params.int_param(QueryDict("page=٣"), "page")


def test_search_words_are_stripped_cut_short_and_refused_with_a_nul_which_postgresql_refuses():
    assert params.text_param(QueryDict("q=+gpu+"), "q") == "gpu"
    assert params.text_param(QueryDict(""), "q") == ""
    assert params.text_param(QueryDict("q=" + "x" * 200), "q", max_length=63) == "x" * 63
    with pytest.raises(params.InvalidParameter, match="without NUL"):
        params.text_param(QueryDict("q=gpu%00"), "q")


def test_a_choice_is_one_of_its_values_or_nothing():
    assert params.choice_param(QueryDict("outcome=done"), "outcome", ["done", "failed"]) == "done"
    assert params.choice_param(QueryDict("outcome="), "outcome", ["done", "failed"]) == ""
    with pytest.raises(params.InvalidParameter, match="Give one of done, failed, not 'AAA'"):
        params.choice_param(QueryDict("outcome=AAA"), "outcome", ["done", "failed"])


def test_id_lists_come_repeated_or_comma_separated_once_each_in_order():
    assert params.id_list(["3,4", "5", "3", "4,"], name="machines") == [3, 4, 5]
    assert params.id_list([], name="machines") == []


@pytest.mark.parametrize("values", [["3,x"], ["3", "١"], [BEYOND_BIGINT], [",".join(["1"] * (params.MAX_IDS + 1))]])
def test_an_id_list_with_one_bad_id_or_too_many_is_refused_whole(values):
    with pytest.raises(params.InvalidParameter) as refused:
        params.id_list(values, name="machines")
    assert refused.value.name == "machines"


def test_ids_in_urls_are_digits_within_the_bigint_range():
    converter = params.IdConverter()
    assert converter.to_python(str(params.ID_MAX)) == params.ID_MAX
    with pytest.raises(ValueError):
        converter.to_python("9" * 19)  # 19 digits, past the range: this URL matches nothing
    with pytest.raises(ValueError):
        converter.to_python("0")


# -- JSON bodies ------------------------------------------------------------------------------------


def nested(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def test_json_nested_up_to_the_limit_is_read():
    assert bodies.json_loads(nested(bodies.MAX_DEPTH)) == eval("[" * bodies.MAX_DEPTH + "]" * bodies.MAX_DEPTH)
    assert bodies.json_loads(b'{"a": {"b": [1, {"c": null}]}}') == {"a": {"b": [1, {"c": None}]}}


@pytest.mark.parametrize("levels", [bodies.MAX_DEPTH + 1, 100_000])  # the second past Python's recursion limit
def test_json_nested_past_the_limit_is_refused_as_too_deep(levels):
    with pytest.raises(bodies.BodyRefused) as refused:
        bodies.json_loads(nested(levels))
    assert refused.value.status == 400
    assert refused.value.message == "The JSON body nests deeper than 32 levels of lists and objects."


def test_objects_count_as_levels_like_lists():
    deep = b'{"a": ' * 40 + b"1" + b"}" * 40
    with pytest.raises(bodies.BodyRefused, match="nests deeper"):
        bodies.json_loads(deep)


@pytest.mark.parametrize("raw", [b"not json", b"\xff\xfe", b"[NaN]", b"[Infinity]", b"1" * 5000])
def test_what_is_not_strict_json_is_refused_as_not_json(raw):
    with pytest.raises(bodies.BodyRefused, match="^The body is not JSON"):
        bodies.json_loads(raw)


def test_a_body_is_read_up_to_its_limit_and_refused_as_too_large_past_it():
    import io

    assert bodies.read_bounded(io.BytesIO(b"x" * 10), limit=10) == b"x" * 10
    with pytest.raises(bodies.BodyRefused) as refused:
        bodies.read_bounded(io.BytesIO(b"x" * 11), limit=10)
    assert refused.value.status == 413


# -- Range headers (the runtime image download) ----------------------------------------------------


def test_a_range_header_reads_one_range_within_the_size():
    assert requested_range("bytes=0-9", 100) == (0, 9)
    assert requested_range("bytes=90-", 100) == (90, 99)
    assert requested_range("bytes=-5", 100) == (95, 99)


@pytest.mark.parametrize("header", [
    "bytes=" + LONG_NUMBER + "-",  # int() of it raised a ValueError: a 500
    "bytes=0-" + "9" * 20,
    "bytes=٠-٩",  # Arabic-Indic digits
    "bytes=0-1" + " " * 200 + ",5-6",
    "bytes=0-1,5-6",
])
def test_a_range_header_that_is_long_not_ascii_or_several_ranges_is_unsatisfiable(header):
    assert requested_range(header, 100) is None


# -- live topics -------------------------------------------------------------------------------------


@pytest.mark.parametrize("topic", ["machine:12", "cluster:3", "probe:9", "machines", "machines:summary", "clusters"])
def test_each_kind_of_topic_takes_its_own_argument(topic):
    assert live.parse_topic(topic) is not None


@pytest.mark.parametrize("topic", [
    "machine:abc", "machine:" + BEYOND_BIGINT, "machine:012", "machine:0", "machine", "cluster:-1", "probe:1-2",
    "machines:12", "machines:other", "clusters:3", "machine:12\n",
])
def test_a_topic_whose_argument_its_kind_does_not_take_is_refused(topic):
    assert live.parse_topic(topic) is None
