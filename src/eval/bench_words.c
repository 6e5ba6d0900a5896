/* bench_words.c - the word pool of random `lethe bench serve` prompts.
 *
 * The 256 most frequent words of the State of the Union corpus (3 to 9
 * letters) that are one token each, with a leading space, in the SmolLM2
 * (GPT-2 style), Llama-3 and Qwen3 vocabularies (checked with the models'
 * tokenizers when the list was made). Random prompts of N such words are
 * therefore about N tokens long on all three families, without the client
 * needing a tokenizer; the server's usage.prompt_tokens gives the exact count. */
#include "eval/bench_serve.h"

const char *const lethe_bs_words[] = {
    "the", "and", "that", "for", "which", "our", "have", "with", "been", "this", "has", "not",
    "are", "will", "their", "from", "all", "its", "was", "should", "upon", "his", "such", "would",
    "but", "they", "can", "other", "any", "year", "them", "may", "these", "more", "country", "made",
    "people", "public", "were", "than", "under", "those", "time", "great", "now", "who", "must",
    "last", "one", "had", "war", "present", "only", "law", "between", "into", "there", "shall",
    "most", "power", "some", "citizens", "own", "every", "new", "without", "part", "years",
    "necessary", "against", "world", "peace", "service", "national", "subject", "act", "during",
    "well", "foreign", "nations", "system", "two", "also", "when", "interest", "same", "make",
    "many", "laws", "treaty", "work", "here", "before", "policy", "very", "men", "duty", "much",
    "good", "over", "being", "out", "within", "general", "first", "interests", "attention",
    "important", "large", "increase", "both", "through", "you", "free", "business", "could",
    "means", "report", "nation", "commerce", "purpose", "amount", "action", "far", "your", "trade",
    "long", "rights", "countries", "what", "relations", "condition", "right", "powers", "whole",
    "each", "force", "officers", "military", "fiscal", "while", "just", "duties", "however",
    "number", "might", "less", "authority", "still", "progress", "already", "session", "further",
    "thus", "question", "proper", "effect", "given", "among", "revenue", "about", "period",
    "recommend", "past", "use", "where", "yet", "after", "resident", "order", "way", "possible",
    "labor", "give", "day", "state", "taken", "view", "increased", "result", "certain", "course",
    "her", "hey", "measures", "full", "several", "debt", "vessels", "best", "land", "lands",
    "toward", "future", "since", "having", "need", "justice", "character", "claims", "existing",
    "hope", "take", "control", "place", "therefore", "even", "received", "money", "continue",
    "political", "become", "done", "ever", "life", "value", "une", "due", "security", "because",
    "secure", "regard", "property", "economic", "fact", "itself", "per", "then", "whether",
    "making", "meet", "hat", "found", "case", "high", "either", "provision", "provide", "others",
    "believe", "end", "defense", "special", "better", "until", "required", "spirit", "private",
    "three", "effort", "greater", "too", "matter", "man", "capital", "resources",
};
const int32_t lethe_bs_n_words = (int32_t)(sizeof(lethe_bs_words) / sizeof(lethe_bs_words[0]));
