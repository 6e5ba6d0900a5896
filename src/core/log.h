/* log.h - leveled logging to stderr. Level from lethe_log_set_level(). */
#ifndef LETHE_LOG_H
#define LETHE_LOG_H

enum { LETHE_LOG_ERROR = 0, LETHE_LOG_WARN, LETHE_LOG_INFO, LETHE_LOG_DEBUG };

void lethe_log_set_level(int level);
int lethe_log_level(void);
void lethe_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define LOG_ERROR(...) lethe_log(LETHE_LOG_ERROR, __VA_ARGS__)
#define LOG_WARN(...) lethe_log(LETHE_LOG_WARN, __VA_ARGS__)
#define LOG_INFO(...) lethe_log(LETHE_LOG_INFO, __VA_ARGS__)
#define LOG_DEBUG(...) lethe_log(LETHE_LOG_DEBUG, __VA_ARGS__)

#endif /* LETHE_LOG_H */
