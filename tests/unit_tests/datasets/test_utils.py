from megatron.core.datasets.utils import get_blend_from_list


def test_get_blend_from_list_passes_no_data_path_through_as_none():
    # Upstream's providers call get_blend_from_list(args.data_path) also under --mock-data (data_path None).
    assert get_blend_from_list(None) is None


def test_get_blend_from_list_strips_prefixes_as_upstream():
    assert get_blend_from_list([" a_text_document\n"]) == (["a_text_document"], None)
    assert get_blend_from_list(["0.3", " a ", "0.7", "b\n"]) == (["a", "b"], [0.3, 0.7])
