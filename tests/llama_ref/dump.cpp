// Debug tool: run llama.cpp on token ids, dump named F32 tensors of every eval to a binary file.
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>

static FILE * g_out = nullptr;
static int g_eval = 0;

static bool cb(struct ggml_tensor * t, bool ask, void * ud) {
    if (ask) return true;
    if (t->type != GGML_TYPE_F32 || !g_out) return true;
    if (getenv("DUMP_EVALS") && g_eval >= atoi(getenv("DUMP_EVALS"))) return true;
    if (strncmp(t->name, "node_", 5) == 0 || !strchr(t->name, '-')) return true;
    std::vector<float> buf(ggml_nelements(t));
    if (!ggml_is_contiguous(t)) return true;
    ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
    int32_t hdr[6] = {g_eval, (int32_t)strlen(t->name), (int32_t)t->ne[0], (int32_t)t->ne[1], (int32_t)t->ne[2], (int32_t)t->ne[3]};
    fwrite(hdr, 4, 6, g_out);
    fwrite(t->name, 1, strlen(t->name), g_out);
    fwrite(buf.data(), 4, buf.size(), g_out);
    return true;
}

int main(int argc, char ** argv) {
    // dump MODEL IDS_FILE OUT_FILE N_PROMPT [threads]
    const char * model_path = argv[1];
    FILE * f = fopen(argv[2], "r");
    std::vector<llama_token> ids; int v;
    while (fscanf(f, "%d", &v) == 1) ids.push_back(v);
    fclose(f);
    g_out = fopen(argv[3], "wb");
    int n_prompt = atoi(argv[4]);
    int threads = argc > 5 ? atoi(argv[5]) : 2;
    llama_backend_init();
    auto mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(model_path, mp);
    auto cp = llama_context_default_params();
    cp.n_ctx = 4096; cp.n_batch = 4096; cp.n_threads = threads; cp.n_threads_batch = threads;
    cp.cb_eval = cb; cp.cb_eval_user_data = nullptr;
    // DUMP_CTK / DUMP_CTV = f16 | q8_0 | q4_0: the KV cache types (-ctk / -ctv)
    auto cache_type = [](const char * name, ggml_type fallback) {
        if (!name) return fallback;
        std::string s(name);
        return s == "q8_0" ? GGML_TYPE_Q8_0 : s == "q4_0" ? GGML_TYPE_Q4_0 : GGML_TYPE_F16;
    };
    cp.type_k = cache_type(getenv("DUMP_CTK"), cp.type_k);
    cp.type_v = cache_type(getenv("DUMP_CTV"), cp.type_v);
    llama_context * ctx = llama_init_from_model(model, cp);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * lg = fopen((std::string(argv[3]) + ".logits").c_str(), "wb");
    llama_batch b = llama_batch_get_one(ids.data(), n_prompt);
    if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
    fwrite(llama_get_logits_ith(ctx, -1), 4, n_vocab, lg);
    for (size_t i = n_prompt; i < ids.size(); i++) {
        g_eval++;
        llama_batch b1 = llama_batch_get_one(&ids[i], 1);
        if (llama_decode(ctx, b1)) { fprintf(stderr, "decode failed\n"); return 1; }
        fwrite(llama_get_logits_ith(ctx, -1), 4, n_vocab, lg);
    }
    // DUMP_GREEDY=n: then up to n greedy steps (argmax of the last logits; an end-of-generation
    // token is the last), one line each to OUT_FILE.greedy: the token, then the top 10 "id logit"
    const int n_greedy = getenv("DUMP_GREEDY") ? atoi(getenv("DUMP_GREEDY")) : 0;
    FILE * gr = n_greedy > 0 ? fopen((std::string(argv[3]) + ".greedy").c_str(), "w") : nullptr;
    const llama_vocab * vocab = llama_model_get_vocab(model);
    for (int i = 0; i < n_greedy; i++) {
        const float * row = llama_get_logits_ith(ctx, -1);
        std::vector<int> order(n_vocab);
        for (int t = 0; t < n_vocab; t++) order[t] = t;
        std::partial_sort(order.begin(), order.begin() + 10, order.end(),
                          [row](int a, int b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
        llama_token best = order[0];
        fprintf(gr, "%d", best);
        for (int j = 0; j < 10; j++) fprintf(gr, " %d %.9g", order[j], row[order[j]]);
        fprintf(gr, "\n");
        if (llama_vocab_is_eog(vocab, best)) break;
        g_eval++;
        llama_batch b1 = llama_batch_get_one(&best, 1);
        if (llama_decode(ctx, b1)) { fprintf(stderr, "decode failed\n"); return 1; }
    }
    if (gr) fclose(gr);
    fclose(lg); fclose(g_out);
    return 0;
}
