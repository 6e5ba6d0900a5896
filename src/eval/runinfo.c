/* runinfo.c - the conditions every result file carries: commit, date, machine,
 * and a progress bar for long runs.
 *
 * The commit is asked from git about the source tree the running binary was
 * built in (the folder above the executable's folder, i.e. the repo root for
 * build/lethe), falling back to the current directory; "+dirty" is appended
 * when tracked files differ from HEAD; "unknown" without git. The machine is
 * the host name, the CPU model and the core count (+ the device name the
 * caller adds). The progress bar redraws one stderr line when stderr is a
 * terminal and prints a plain line every 10% otherwise (logs stay short). */
#include "eval/runinfo.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/util.h"

static bool run_git(const char *dir, const char *args, char *out, size_t cap) {
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "git -C '%s' %s 2>/dev/null", dir, args);
    FILE *f = popen(cmd, "r");
    if (!f) return false;
    size_t n = fread(out, 1, cap - 1, f);
    int rc = pclose(f);
    out[n] = '\0';
    while (n && (out[n - 1] == '\n' || out[n - 1] == '\r')) out[--n] = '\0';
    return rc == 0;
}

void lethe_runinfo_commit(char *out, size_t cap) {
    char dirs[2][1024] = {"", "."};
    ssize_t n = readlink("/proc/self/exe", dirs[0], sizeof(dirs[0]) - 1);
    if (n > 0) {
        dirs[0][n] = '\0';
        for (int up = 0; up < 2; up++) { /* strip "/lethe", then "/build" */
            char *s = strrchr(dirs[0], '/');
            if (s) *s = '\0';
        }
        if (strchr(dirs[0], '\'')) dirs[0][0] = '\0';
    }
    for (int d = 0; d < 2; d++) {
        if (!dirs[d][0]) continue;
        char h[64], st[256];
        if (!run_git(dirs[d], "rev-parse --short=12 HEAD", h, sizeof(h)) || !h[0]) continue;
        bool dirty = run_git(dirs[d], "status --porcelain --untracked-files=no", st, sizeof(st)) && st[0];
        snprintf(out, cap, "%s%s", h, dirty ? "+dirty" : "");
        return;
    }
    snprintf(out, cap, "unknown");
}

void lethe_runinfo_date(char *out, size_t cap) {
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(out, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

void lethe_runinfo_machine(char *out, size_t cap) {
    char host[128] = "unknown-host", cpu[160] = "unknown CPU";
    gethostname(host, sizeof(host) - 1);
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[512];
        while (fgets(line, sizeof(line), f)) {
            if (strncmp(line, "model name", 10)) continue;
            char *c = strchr(line, ':');
            if (!c) break;
            c++;
            while (*c == ' ' || *c == '\t') c++;
            c[strcspn(c, "\n")] = '\0';
            snprintf(cpu, sizeof(cpu), "%s", c);
            break;
        }
        fclose(f);
    }
    snprintf(out, cap, "%s: %s, %ld cores", host, cpu, sysconf(_SC_NPROCESSORS_ONLN));
}

/* ---- progress --------------------------------------------------------------- */

void lethe_progress_init(lethe_progress *p, const char *what, int64_t total, bool enabled) {
    memset(p, 0, sizeof(*p));
    snprintf(p->what, sizeof(p->what), "%s", what);
    p->total = total > 0 ? total : 1;
    p->enabled = enabled;
    p->tty = isatty(STDERR_FILENO) != 0;
    p->t0 = lethe_time_s();
    p->last_pct = -1;
}

static void fmt_eta(char *out, size_t cap, double s) {
    if (!(s >= 0) || s > 1e7) snprintf(out, cap, "?");
    else if (s < 60) snprintf(out, cap, "%.0fs", s);
    else if (s < 3600) snprintf(out, cap, "%dm%02ds", (int)s / 60, (int)s % 60);
    else snprintf(out, cap, "%dh%02dm", (int)s / 3600, ((int)s % 3600) / 60);
}

void lethe_progress_update(lethe_progress *p, int64_t done, const char *detail) {
    if (!p->enabled) return;
    if (done > p->total) done = p->total;
    p->done = done;
    double el = lethe_time_s() - p->t0;
    double frac = (double)done / (double)p->total;
    char eta[32], elapsed[32];
    fmt_eta(eta, sizeof(eta), done > 0 ? el / frac - el : -1);
    fmt_eta(elapsed, sizeof(elapsed), el);
    if (p->tty) {
        char bar[31];
        int fill = (int)(frac * 30);
        for (int i = 0; i < 30; i++) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
        bar[30] = '\0';
        fprintf(stderr, "\r\033[K%s [%s] %lld/%lld %s elapsed %s eta %s", p->what, bar,
                (long long)done, (long long)p->total, detail ? detail : "", elapsed, eta);
        fflush(stderr);
        return;
    }
    int pct = (int)(frac * 10) * 10;
    if (pct == p->last_pct && done != p->total) return;
    p->last_pct = pct;
    fprintf(stderr, "%s: %lld/%lld (%d%%) %s elapsed %s eta %s\n", p->what, (long long)done,
            (long long)p->total, (int)(frac * 100), detail ? detail : "", elapsed, eta);
}

void lethe_progress_done(lethe_progress *p) {
    if (p->enabled && p->tty) fputc('\n', stderr);
}
