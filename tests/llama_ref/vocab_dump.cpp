// Debug tool: llama.cpp's view of a model's vocabulary and tokenizer.
//   vocab_dump MODEL attrs            -> "id attr eog" for every token whose attr is not NORMAL
//   vocab_dump MODEL tokenize FILE S B -> the ids of FILE's text (S=1: parse special tokens; B=1: BOS as the model adds it)
//   vocab_dump MODEL tokenize_many FILE -> one line of ids per text of FILE (texts separated by \x1e; plain, no BOS)
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const llama_vocab * vocab = llama_model_get_vocab(model);
    if (strcmp(argv[2], "attrs") == 0) {
        for (int id = 0; id < llama_vocab_n_tokens(vocab); id++) {
            int attr = llama_vocab_get_attr(vocab, id);
            bool eog = llama_vocab_is_eog(vocab, id);
            if (attr != LLAMA_TOKEN_ATTR_NORMAL || eog) printf("%d %d %d\n", id, attr, eog ? 1 : 0);
        }
        return 0;
    }
    std::ifstream f(argv[3], std::ios::binary);
    std::stringstream ss; ss << f.rdbuf();
    std::string text = ss.str();
    if (strcmp(argv[2], "tokenize_many") == 0) {
        size_t start = 0;
        while (start <= text.size()) {
            size_t end = text.find('\x1e', start);
            if (end == std::string::npos) end = text.size();
            std::string one = text.substr(start, end - start);
            std::vector<llama_token> ids(one.size() + 16);
            int n = llama_tokenize(vocab, one.data(), (int) one.size(), ids.data(), (int) ids.size(), false, false);
            for (int i = 0; i < n; i++) printf("%d ", ids[i]);
            printf("\n");
            start = end + 1;
        }
        return 0;
    }
    bool special = atoi(argv[4]) != 0;
    bool add_special = argc > 5 && atoi(argv[5]) != 0;
    std::vector<llama_token> ids(text.size() + 16);
    int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), add_special, special);
    for (int i = 0; i < n; i++) printf("%d ", ids[i]);
    printf("\n");
    return 0;
}
